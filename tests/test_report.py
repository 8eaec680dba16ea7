"""`nanolm report`: the panels, the dashboard and the HTML page, for one run and several."""

import base64
import json
import re
import shutil

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from nanolm.instruments.cli import main  # noqa: E402
from nanolm.instruments.report import PANELS, load_run, render  # noqa: E402
from nanolm.watch.sinks import read_metrics  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
EXPECTED = [
    "loss",
    "val_bpb",
    "grad_norm",
    "lr",
    "clipped_frac",
    "tokens_per_sec",
    "mfu",
    "memory",
    "weight_norm",
    "layer_grad_norm",
    "update_ratio",
    "attn_logit_max",
    "mlp_dead_frac",
    "act_rms",
]


@pytest.fixture(scope="module")
def rendered(observed_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return render([observed_run], out), out


def test_report_renders_every_panel_of_a_run(rendered):
    result, out = rendered
    assert result["panels"] == EXPECTED  # no fp16 here: no loss-scale panel
    for name in EXPECTED:
        assert (out / "panels" / f"{name}.png").read_bytes().startswith(PNG), name
    assert (out / "dashboard.png").read_bytes().startswith(PNG)
    page = (out / "report.html").read_text()
    assert re.findall(r'<figure id="panel-([a-z_]+)"', page) == EXPECTED
    images = re.findall(r'src="([^"]*)"', page)
    assert len(images) == len(EXPECTED)
    assert all(base64.b64decode(src.split(",", 1)[1]).startswith(PNG) for src in images)  # self-contained
    text = re.sub(r'src="data:image/png;base64,[^"]*"', "", page)
    assert not re.search(r"(src|href)=|url\(|@import", text)  # nothing to fetch from anywhere


def test_loss_scale_panel_appears_when_rows_have_a_loss_scale(observed_run, tmp_path):
    run = tmp_path / "fp16"
    shutil.copytree(observed_run, run, ignore=shutil.ignore_patterns("report", "tensorboard"))
    rows = read_metrics(run / "metrics.jsonl")
    for i, row in enumerate(rows[1:]):
        row["loss_scale"] = 65536.0 / 2 ** (i // 2)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert render([run], tmp_path / "out")["panels"][-1] == "loss_scale"


def _lines(panel_name, runs):
    panel = next(p for p in PANELS if p.name == panel_name)
    ax = Figure().add_subplot()
    panel.draw(ax, runs, "step", ["C0", "C1", "C2"][: len(runs)])
    return [line for line in ax.get_lines() if list(line.get_xdata()) != [0, 1]]  # not the reference lines


def test_several_runs_overlay_on_the_same_axes(observed_run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(observed_run, other, ignore=shutil.ignore_patterns("report", "tensorboard"))
    config = (other / "config.toml").read_text()
    (other / "config.toml").write_text(config.replace("batch_size = 4", "batch_size = 2\n# edited"))
    one, two = load_run(observed_run), load_run(other)
    for panel in ("loss", "grad_norm", "update_ratio", "attn_logit_max"):
        assert len(_lines(panel, [one, two])) == 2 * len(_lines(panel, [one])), panel
    assert main(["report", str(observed_run), str(other), "--out", str(tmp_path / "both")]) == 0
    assert "report.html" in capsys.readouterr().out
    page = (tmp_path / "both" / "report.html").read_text()
    assert "Options that differ" in page and "train.batch_size" in page


def test_tokens_on_the_horizontal_axis_scale_steps_by_tokens_per_step(observed_run):
    run = load_run(observed_run)
    steps, _ = run.series("loss", "step")
    tokens, _ = run.series("loss", "tokens")
    assert tokens == [s * 4 * 32 for s in steps]


def test_report_of_a_directory_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a run directory" in err[0]
