"""The ``voodoo`` command line: parsing only. Each command builds its config and calls the API."""
