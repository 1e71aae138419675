"""The `tierq` command line (`cli.main:main`): one entry point for every component and tool."""
