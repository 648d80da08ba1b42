import io
import subprocess
import sys

from tlm_core.progress import progress_bar


def test_disabled_bar_accepts_every_call_and_draws_nothing(capsys):
    with progress_bar(False, total=10) as bar:
        bar.update(2)
        bar.update()  # tqdm's default step is 1
        bar.set_postfix(loss="1.0")
        bar.set_description("x")
    bar.close()
    assert bar.n == 3
    assert capsys.readouterr().err == ""


def test_enabled_bar_draws_to_the_given_file():
    out = io.StringIO()
    with progress_bar(True, total=4, file=out, desc="work") as bar:
        bar.update(4)
    assert "work" in out.getvalue() and "4/4" in out.getvalue()


def test_default_shows_only_on_a_terminal():
    # stderr is a pipe here: tqdm's disable=None rule keeps it silent.
    code = "from tlm_core.progress import progress_bar\nwith progress_bar(None, total=3) as b: b.update(3)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr == ""


def test_a_disabled_bar_does_not_import_tqdm():
    code = "import sys\nfrom tlm_core.progress import progress_bar\nprogress_bar(False)\nprint('tqdm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
