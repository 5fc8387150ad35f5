"""API-stability markers shared by every mcore package.

``internal_api`` and ``experimental_api`` label objects whose signatures may change without a
deprecation cycle; ``deprecated`` labels objects that will be removed and warns their callers.
The project's API checker (``tools/api_compat``) reads these markers and exempts the objects
they decorate, and their members, from backward-compatibility checks.
"""

from importlib.metadata import version as _version

from mcore_api._deprecation import deprecated
from mcore_api._stability import experimental_api, internal_api

__version__ = _version("mcore-api")

__all__ = ["__version__", "deprecated", "experimental_api", "internal_api"]
