"""The `frugality` command line. Heavy modules (torch) load inside each command, so
`frugality --help` answers at once."""
