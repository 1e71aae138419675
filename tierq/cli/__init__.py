"""The `tierq` command line (`tierq.cli.main:main`): one entry point for every component and
tool."""
