"""The Python client of the platform's HTTP API that the command line (`tierq batch`) and the
benchmarks (`tierq bench batch`) share."""
