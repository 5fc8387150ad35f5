"""API compatibility and package-boundary checker of the mcore workspace, built on griffe."""
