"""`make test PYTEST_ARGS=--jax-times`: where the suite's time goes, per test file. Each test's wall
seconds beside its seconds of XLA compiling, JAX tracing and lowering to StableHLO in the test's own
process (jax.monitoring's events; a script the test starts counts in its wall time only), and how
many programs were compiled and how many the persistent cache gave back. On this suite's CPU runs
compiling dominates (conftest.py): the numbers say which tests to give fewer distinct programs."""

import collections
import json
import time

import pytest

EVENTS = {"compile_s": "/jax/core/compile/backend_compile_duration",
          "trace_s": "/jax/core/compile/jaxpr_trace_duration",
          "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "cache_hits": "/jax/compilation_cache/cache_retrieval_time_sec"}
COLUMNS = ("wall_s", *EVENTS, "programs")


def pytest_addoption(parser):
    parser.addoption("--jax-times", action="store_true",
                     help="per test file: wall, XLA compile, trace and lowering seconds, programs compiled")


def pytest_configure(config):
    if config.getoption("--jax-times"):
        config.pluginmanager.register(JaxTimes(config), "jax_times_recorder")


class JaxTimes:
    def __init__(self, config):
        import jax.monitoring  # here, not at the top: loaded for every run, the plugin imports nothing unasked

        self.config, self.current = config, None
        self.per_file = collections.defaultdict(collections.Counter)  # file -> column -> total
        names = {event: name for name, event in EVENTS.items()}

        def listen(event, seconds, **_):
            if self.current is not None and event in names:
                row = self.per_file[self.current]
                row[names[event]] += 1 if names[event] == "cache_hits" else seconds
                row["programs"] += event == EVENTS["compile_s"]
        jax.monitoring.register_event_duration_secs_listener(listen)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        self.current, start = item.nodeid.split("::")[0], time.perf_counter()
        yield
        self.per_file[self.current]["wall_s"] += time.perf_counter() - start
        self.current = None

    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workeroutput"):  # an xdist worker: its totals go to the controller
            self.config.workeroutput["jax_times"] = json.dumps(self.per_file)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        for file, row in json.loads(getattr(node, "workeroutput", {}).get("jax_times", "{}")).items():
            self.per_file[file].update(row)

    def pytest_terminal_summary(self, terminalreporter):
        line = lambda row, name: " ".join(f"{row[c]:10.1f}" if c.endswith("_s") else f"{row[c]:10d}"
                                          for c in COLUMNS) + f"  {name}"
        terminalreporter.section("JAX time per test file (seconds, summed over the workers)")
        terminalreporter.write_line(" ".join(f"{c:>10}" for c in COLUMNS) + "  file")
        for file, row in sorted(self.per_file.items(), key=lambda kv: -kv[1]["wall_s"]):
            terminalreporter.write_line(line(row, file))
        terminalreporter.write_line(line(sum(self.per_file.values(), collections.Counter()), "all"))
