"""The card and the report print, for each bar, the noise floor in the unit its threshold used (issue 42).

One whole playbook session on the agent tests' small lab (tests/agent/labkit.py) with `floor_unit = "replicates"`,
not the default: its nominee's card (the bundle's README.md) and the session report must print, for every
noise-floor bar of every verdict, the floor its threshold was written in (threshold = value x floor), as the verdict
recorded it. The default unit (`resolvable`, where the floor may be coarser than the replicates' mean absolute
delta) is checked on the agent tests' finished session by `check_printed_floors` in tests/memory/test_report.py.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memory.notebook import Notebook
from memory.report import write_report
from memory.state import fold

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from labkit import make_lab  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SESSION = "f1"


def check_printed_floors(lab: Path, session: str, unit: str) -> int:
    """Assert that the nominee's card and the report print each noise-floor bar's floor in its threshold's unit;
    returns how many (verdict, bar) floors were checked."""
    out = lab.parent / f"report-{session}.html"
    write_report(lab / "notebook.db", session, out)
    report = out.read_text()
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        state = fold(nb, session)
        card = (Path(nb.artifacts(kind="bundle", session=session)[-1].path) / "README.md").read_text()
        assert state.bars is not None and state.bars.floor_unit == unit
        checked = 0
        for v in state.verdicts:
            article = report[report.index(f'id="comparison-{v.comparison_id}"'):]
            article = article[:article.index("</article>")]
            for i, (b, f) in enumerate(zip(v.bars, v.floors, strict=True)):
                if not b.bar.in_noise_units:
                    assert f is None
                    continue
                floor = nb.noise_floor(f.floor_id)
                assert f.recorded and f.floor_unit == unit and f.unit == b.floor
                assert b.threshold == pytest.approx(b.bar.value * f.unit)  # the unit the threshold was written in
                expected = floor.mean_abs_delta if unit == "replicates" else max(
                    floor.mean_abs_delta, next(x for x in state.floors if x.record.id == floor.id).resolution)
                assert f.unit == pytest.approx(expected)
                # The card: the verdict's row cites the floor it recorded, with the number the threshold used.
                cited = re.search(rf"noise floor (\S+?)<!-- nb comparison:{v.comparison_id} verdicts\.{i}\.floor -->",
                                  card)
                assert cited is not None, f"the card does not cite comparison {v.comparison_id}'s floor of bar {i}"
                assert float(cited.group(1)) == pytest.approx(f.unit, rel=1e-3)
                # The report: the bar's row shows the same floor, named by its unit.
                row = next(r for r in re.findall(r"<tr><td>.*?</tr>", article)
                           if html.unescape(r).startswith(f"<tr><td>{b.bar.target} {b.bar.text()}</td>"))
                assert f"<td>{f.unit + 0.0:.4g} ({unit})</td>" in row, row
                checked += 1
        # The evaluation table's noise-floor cell of each bar's metric is the one a verdict of the nominee recorded.
        for v in state.of(state.nominee):
            for i, f in enumerate(v.floors):
                if f is not None:
                    assert f"verdicts.{i}.floor -->" in card
    return checked


@pytest.fixture(scope="module")
def replicates_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lab = make_lab(tmp_path_factory.mktemp("floors") / "lab")
    bars = lab / "bars.toml"
    bars.write_text('floor_unit = "replicates"\n' + bars.read_text())
    done = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "5gpuh", "--lab", str(lab),
                           "--session", SESSION, "--protocol", "test", "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return lab


def test_card_and_report_print_each_bars_floor_in_its_thresholds_unit_under_replicates(replicates_session):
    assert check_printed_floors(replicates_session, SESSION, "replicates") >= 1
    # Not vacuous: some floor a verdict used is coarser under the default rule than under this session's (its suite
    # resolves less finely than its replicates differ), so a card or a report printing the wrong rule's number
    # would fail above.
    with Notebook.open(replicates_session / "notebook.db", readonly=True) as nb:
        state = fold(nb, SESSION)
    used = {f.floor_id for v in state.verdicts for f in v.floors if f is not None}
    differing = [x for x in state.floors if x.record.id in used and x.resolution > x.record.mean_abs_delta]
    assert differing, [(x.record.id, x.record.mean_abs_delta, x.resolution) for x in state.floors]
    assert all(x.unit("replicates") < x.unit("resolvable") for x in differing)
