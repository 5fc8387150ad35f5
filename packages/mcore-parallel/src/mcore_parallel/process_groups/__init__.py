"""Process groups: the rank grid, the collection of groups handed to modules, and their construction."""
