import pytest

from .helpers import INTERPRETER_SCRIPTS, start_under_interpreter


@pytest.fixture(scope="session")
def interpreter_runs():
    """Both interpreter scripts, started together on first use: each is one single-threaded
    process for about a minute, so on two cores the pair takes the time of one."""
    procs = {script: start_under_interpreter(script) for script in INTERPRETER_SCRIPTS}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
