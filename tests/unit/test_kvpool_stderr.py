"""`stderr_to`: what a C++ library writes to fd 2 while a store sets up goes to the run's log."""

import os
import subprocess
import sys
import textwrap


def test_stderr_to_sends_fd2_to_the_file_and_restores_it(tmp_path):
    log = tmp_path / "kvpool-cleaner.log"
    # In a child, so the test runner's own stderr is never touched; os.write(2, ...) is what glog does.
    script = textwrap.dedent(f"""
        import os
        from seerd.kvpool.store import stderr_to
        with stderr_to({str(log)!r}):
            os.write(2, b"I1127 glog line\\n")
        os.write(2, b"after\\n")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert log.read_text() == "I1127 glog line\n"
    assert out.stderr == "after\n"
    assert os.stat(log).st_mode & 0o777 == 0o600


def test_stderr_to_none_leaves_stderr_alone(tmp_path):
    script = textwrap.dedent("""
        import os
        from seerd.kvpool.store import stderr_to
        with stderr_to(None):
            os.write(2, b"kept\\n")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stderr == "kept\n"
