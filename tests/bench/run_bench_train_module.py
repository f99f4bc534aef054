"""`python -m frugality.bench.train ARGS` as a script (tests/forked_cli.py runs scripts): the
module run as `-m` runs it, with the working directory's path first, not this folder's
(run as a path, src/frugality/bench/profile.py would shadow the standard library's)."""

import runpy

runpy.run_module("frugality.bench.train", run_name="__main__", alter_sys=True)
