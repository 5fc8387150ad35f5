"""Test support shared by the tests of every mcore package.

It depends on pytest and, where it runs ranks, on torch; never on an mcore package, so each
package's tests can use it against that package's wheel installed alone.
"""
