"""Ferrum's configuration: the server's settings (server_settings.py) and how they are read from
defaults, a YAML file, `FERRUM_*` environment variables and command-line flags (loader.py)."""
