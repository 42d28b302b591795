"""The console scripts where an extra is not installed: one line naming the package and the extra, no traceback, and
nothing written; the sweep report writes its table without the chart's matplotlib. Each in a process of its own, the
package made missing there (``sys.modules[name] = None``: importing it raises ``ModuleNotFoundError``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cltrain.app.metrics_file import write_metrics
from tests.helpers import warm


def _script(module: str, missing: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.modules[{missing!r}] = None; sys.argv = ['x', *sys.argv[1:]]\n"
            f"from {module} import main; sys.exit(main())")
    return warm.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("script,module,missing,args,extra", [
    ("cltrain-train", "cltrain.tools.train", "hydra", ["experiment=smoke"], "app"),
    ("cltrain-data-check", "cltrain.tools.data_check", "PIL", ["folder"], "data"),
    ("cltrain-pack", "cltrain.tools.pack", "webdataset", ["folder", "out"], "shards"),
])
def test_a_missing_extra_is_one_line_and_nothing_is_written(tmp_path, script, module, missing, args, extra) -> None:
    from tests.helpers.data_fixtures import write_image_folder

    write_image_folder(tmp_path / "folder", classes=2, train=2, val=1, size=(32, 24))
    before = sorted(p.name for p in tmp_path.iterdir())
    done = _script(module, missing, *args, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"{script}: error: needs {missing}, which cltrain's {extra!r} extra brings: pip install 'cltrain[{extra}]'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output folder, no run directory


def test_the_sweep_report_writes_its_table_without_matplotlib(tmp_path) -> None:
    for i, (cl, speed) in enumerate(((False, 10.0), (True, 12.5))):
        (tmp_path / str(i)).mkdir()
        write_metrics(tmp_path / str(i), {"model": "resnet50", "image_size": 112, "global_batch": 32, "device": "cpu",
                                          "channels_last": cl, "precision": "32-true", "images_per_second": speed,
                                          "step_time_s": 32 / speed, "val_top1": 50.0, "val_top5": 90.0})
    done = _script("cltrain.tools.sweep_report", "matplotlib", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the chart needs matplotlib: pip install 'cltrain[report]'" in done.stdout
    assert "1.25x" in (tmp_path / "report.md").read_text() and not (tmp_path / "report.png").exists()


@pytest.mark.parametrize("script,module", [("cltrain-data-check", "cltrain.data.check"), ("cltrain-pack", "cltrain.data.pack")])
def test_the_usage_names_the_command_that_ran(tmp_path, script, module) -> None:
    code = f"import sys; sys.argv = [{script!r}, '--help']\nfrom {module} import main; sys.exit(main())"
    assert warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout.startswith(
        f"usage: {script} ")
    module_run = warm.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert module_run.stdout.startswith(f"usage: python -m {module} ")


def test_python_m_of_each_console_script_runs_it(tmp_path) -> None:
    # `python -m cltrain.tools.train ...` imported the module, trained nothing and exited 0
    for module, args, expected in [("cltrain.tools.train", ["model=resnet5"], "did you mean model=resnet50"),
                                   ("cltrain.tools.audit", ["resnet5"], "closest: resnet50")]:
        done = warm.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 2 and expected in done.stderr, (module, done.returncode, done.stderr[-2000:])
