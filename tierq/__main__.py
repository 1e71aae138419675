"""`python -m tierq ...`: the `tierq` command, for children started with this interpreter."""

from tierq.cli.main import main

main()
