"""How a script run by a test must have ended: exit status 0, its ranks'
": ok" lines, and no line saying "leaked" (nanobind's reports at exit of
gradkit objects, functions or types still alive then: a reference cycle, or
an object kept by something Python does not free; docs/python.md, "At
exit")."""


def assert_clean_exit(done, ok_lines=None):
    """`done` is a finished subprocess.run(..., capture_output=True, text=True); `ok_lines`
    the number of ": ok" lines it must have printed (None: not counted)."""
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert ok_lines is None or done.stdout.count(": ok") == ok_lines, done.stdout
    leaked = [line for line in output.splitlines() if "leaked" in line]
    assert leaked == [], "reports at exit:\n" + "\n".join(leaked[:40])
