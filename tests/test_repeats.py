"""``osfarm eval --repeats K`` and the numbers across repeats (issue 25, item 2).

The statistics (osfarm.runner.variance) against values worked out by hand; then real eval runs
of suites/mini with two repeats on the session's sandbox farm (replay solves every task, noop
none): every repeat is its own episode, record and OSWorld folder, results.json has the per-task
counts, ``osfarm report compare`` gives the paired test, and in Debian's Chromium the leaderboard
shows mean ± s.e., pass@k, pass^k and the flip rate and the compare page the test's verdict.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from test_dashboard import _Server  # the standalone /ui app in a thread
from typer.testing import CliRunner

from osfarm.cli import app
from osfarm.dashboard.app import create_ui_app
from osfarm.dashboard.compare import compare
from osfarm.dashboard.runs import EvalRun, TaskRow
from osfarm.farm.server import FarmServer
from osfarm.runner.run import RunOptions, run_eval
from osfarm.runner.variance import (
    Outcome,
    TaskCount,
    flip_rate,
    mean_se,
    paired_test,
    pass_at_k,
    pass_hat_k,
    repeat_stats,
    sign_flip_p,
    t975,
)

MINI = Path(__file__).resolve().parent.parent / "suites" / "mini"
CHROMIUM = Path("/usr/bin/chromium")

# -- the statistics, by hand ------------------------------------------------------------------------


def test_pass_at_k_and_pass_hat_k_by_hand() -> None:
    # n=5 samples, c=2 successes, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; all succeed: C(2,2)/C(5,2) = 1/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_hat_k(5, 2, 2) == pytest.approx(0.1)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) == pass_hat_k(4, 1, 1)  # k=1: both are c/n
    assert pass_at_k(3, 2, 2) == 1.0  # only one failure: any 2 draws hold a success
    assert pass_at_k(5, 0, 3) == 0.0 and pass_hat_k(5, 5, 3) == 1.0
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="successes c=4"):
        pass_hat_k(3, 4, 1)


def test_mean_se_and_flip_rate_by_hand() -> None:
    m, se = mean_se([1.0, 0.0, 1.0, 0.0])
    assert m == 0.5 and se == pytest.approx(math.sqrt(1 / 3) / 2)  # sample sd sqrt(1/3), over sqrt(4)
    assert mean_se([0.4]) == (0.4, None)
    counts = {"a": TaskCount(2, 1), "b": TaskCount(2, 2), "c": TaskCount(2, 0), "d": TaskCount(1, 1)}
    assert flip_rate(counts) == pytest.approx(1 / 3)  # d has one repeat: not counted
    assert flip_rate({"d": TaskCount(1, 0)}) is None


def test_repeat_stats_of_a_run() -> None:
    # 2 tasks x 3 repeats: t1 succeeds in repeats 1 and 2, t2 only in repeat 3
    outs = [Outcome("t1", 1, True), Outcome("t1", 2, True), Outcome("t1", 3, False),
            Outcome("t2", 1, False), Outcome("t2", 2, False), Outcome("t2", 3, True)]
    s = repeat_stats(outs)
    assert s is not None and (s.tasks, s.repeats, s.k) == (2, 3, 3)
    assert s.mean == pytest.approx(0.5)  # every repeat solved 1 of 2
    assert s.se == 0.0
    assert s.pass_at_k == 1.0  # each task succeeded at least once in its 3
    assert s.pass_hat_k == 0.0  # neither succeeded all 3 times
    assert s.flip_rate == 1.0 and s.flipped == 2


def test_student_t_quantiles_match_the_tables() -> None:
    for df, table in ((1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042), (120, 1.980)):
        assert t975(df) == pytest.approx(table, abs=2e-3), df


def test_sign_flip_test_is_exact_mcnemar_with_one_episode_per_task() -> None:
    # 1 task gained, 6 lost (7 discordant): exact McNemar p = 2 * P(X <= 1 | Bin(7, 1/2)) = 2 * 8/128
    diffs = [Fraction(1)] + [Fraction(-1)] * 6 + [Fraction(0)] * 5
    assert sign_flip_p(diffs) == pytest.approx(0.125)
    assert sign_flip_p([Fraction(1)] * 7) == pytest.approx(2 / 128)
    assert sign_flip_p([Fraction(0)] * 3) == 1.0
    # rates over repeats: |+-1/2 +-1/2 +-1| >= 2 only with all signs equal: 2 of 8 assignments
    assert sign_flip_p([Fraction(1, 2), Fraction(1, 2), Fraction(1)]) == pytest.approx(0.25)


def test_paired_test_difference_and_interval() -> None:
    a = {t: TaskCount(1, 0) for t in "wxyz"}
    b = {"w": TaskCount(1, 1), "x": TaskCount(1, 0), "y": TaskCount(1, 0), "z": TaskCount(1, 1),
         "only-b": TaskCount(1, 1)}
    t = paired_test(a, b)
    assert t.tasks == 4 and t.mean_diff == 0.5 and (t.better, t.worse) == (2, 0)
    half = 3.182 * math.sqrt(1 / 3) / 2  # t(3) * sd([1, 0, 0, 1]) / sqrt(4)
    assert t.interval is not None and t.interval == pytest.approx((0.5 - half, 0.5 + half), abs=1e-3)
    assert t.p_value == pytest.approx(0.5) and "McNemar" in t.test  # 2 discordant, both one way: 2/4
    assert not t.significant() and "not significant" in t.verdict()
    many = paired_test({str(i): TaskCount(2, 0) for i in range(12)}, {str(i): TaskCount(2, 2) for i in range(12)})
    assert many.p_value == pytest.approx(2 / 2**12) and "permutation" in many.test
    assert many.significant() and "B (the second run) is better" in many.verdict()


def test_compare_pairs_tasks_over_their_repeats() -> None:
    def run(key: str, got: dict[str, list[str]]) -> EvalRun:
        return EvalRun(key, [TaskRow(task_id=t, domain="os", status=s, repeat=i)
                             for t, ss in got.items() for i, s in enumerate(ss, 1)])

    a = run("a", {"t1": ["failure", "failure"], "t2": ["success", "failure"], "t3": ["success", "success"]})
    b = run("b", {"t1": ["success", "failure"], "t2": ["success", "failure"], "t3": ["success", "success"]})
    assert a.repeats is not None and a.repeats.flip_rate == pytest.approx(1 / 3)
    cmp = compare(a, b)
    assert (cmp.rate_a.successes, cmp.rate_a.n, cmp.rate_b.successes) == (3, 6, 4)
    assert [f.task_id for f in cmp.gained] == ["t1"] and not cmp.lost
    assert cmp.gained[0].b_count == TaskCount(2, 1)
    assert cmp.test.mean_diff == pytest.approx(1 / 6) and cmp.test.p_value == 1.0  # one task: either sign ties
    assert EvalRun("k1", [TaskRow(task_id="t", status="success")]).repeats is None  # no repeats, no numbers


@pytest.mark.unit  # names the celery executor, starts nothing
def test_bad_repeats_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        RunOptions(suite=MINI, agent="noop", out=tmp_path, repeats=0).repeat_indices()
    assert RunOptions(suite=MINI, agent="noop", out=tmp_path, repeats=2, executor="celery").repeat_indices() == [1, 2]
    assert RunOptions(suite=MINI, agent="noop", out=tmp_path).repeat_indices() == [None]


# -- real runs with repeats --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repeated_runs(farm: FarmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """suites/mini (3 tasks) on the session's farm: the replay agent (solves all) twice per task
    through ``osfarm eval --repeats 2``, the noop agent (one step, solves none) once per task through
    run_eval (a run without repeats, compared against one with them)."""
    runs = tmp_path_factory.mktemp("repeat-runs")
    res = CliRunner().invoke(app, ["eval", "--suite", str(MINI), "--agent", "replay", "--out", str(runs / "replay-x2"),
                                   "--url", farm.url, "--token", farm.token, "--no-progress", "--repeats", "2",
                                   "--envs", "2"])  # the command itself, in this process (no second interpreter)
    assert res.exit_code == 0, res.output
    run_eval(RunOptions(suite=MINI, agent="noop", out=runs / "noop-x1", max_steps=1, url=farm.url, token=farm.token,
                        progress=False, max_concurrent=2), console=Console(file=io.StringIO()))
    return runs


def test_eval_repeats_keeps_every_episode(repeated_runs: Path) -> None:
    out = repeated_runs / "replay-x2"
    summary = json.loads((out / "results.json").read_text())
    assert summary["repeats"] == 2 and summary["n_tasks"] == 6  # rows: 3 tasks x 2 repeats
    assert sorted((r["task_id"][-2:], r["repeat"]) for r in summary["tasks"]) == [
        (t, i) for t in ("01", "02", "03") for i in (1, 2)]
    assert {c["episodes"] for c in summary["task_counts"].values()} == {2}
    assert {c["successes"] for c in summary["task_counts"].values()} == {2}
    var = summary["variance"]
    assert (var["mean_success_rate"], var["standard_error"], var["pass_at_k"], var["pass_hat_k"],
            var["flip_rate"], var["k"]) == (1.0, 0.0, 1.0, 1.0, 0.0, 2)
    records = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["repeat"] for r in records) == [1, 1, 1, 2, 2, 2]
    assert len({r["episode_id"] for r in records}) == 6  # each repeat is its own episode
    for r in summary["tasks"]:  # and its own OSWorld folder
        assert (out / f"repeat-{r['repeat']}" / r["domain"] / r["task_id"] / "result.txt").read_text() == "1.0\n"
    noop = json.loads((repeated_runs / "noop-x1" / "results.json").read_text())
    assert noop["repeats"] == 1 and "variance" not in noop and "repeat" not in noop["tasks"][0]  # as before
    first = noop["tasks"][0]
    assert (repeated_runs / "noop-x1" / first["domain"] / first["task_id"] / "result.txt").is_file()


def test_report_compare_prints_the_paired_test(repeated_runs: Path) -> None:
    res = CliRunner().invoke(app, ["report", "compare", str(repeated_runs / "noop-x1"),
                                   str(repeated_runs / "replay-x2")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "pass@2 100.0%, pass^2 100.0%, flip rate 0.0% (0/3)" in text
    assert "0.0% [0.0%, 56.1%] (one episode per task)" in text  # noop: no repeats, its Wilson interval
    # 3 tasks, each +1: exact sign-flip p = 2/8; three tasks cannot reach 0.05
    assert "exact paired sign-flip permutation over 3 tasks: B - A = +100.0%" in text and "p = 0.25" in text
    assert "not significant at 0.05" in text
    bad = CliRunner().invoke(app, ["report", "compare", str(repeated_runs / "nowhere"),
                                   str(repeated_runs / "replay-x2")])
    assert bad.exit_code == 2


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (scripts/system-packages.txt)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        yield b
        b.close()


def test_leaderboard_and_compare_page_show_repeats(repeated_runs: Path, browser: Any) -> None:
    token = "repeats-ui-token-0123456789"
    with _Server(create_ui_app(repeated_runs, token=token)) as url:
        page = browser.new_context(base_url=url).new_page()
        page.goto("/ui/login?next=/ui/runs")
        page.fill("input[name=token]", token)
        page.click("button[type=submit]")
        page.wait_for_url("**/ui/runs")
        row = page.locator("#leaderboard tbody tr", has_text="replay-x2")
        assert row.locator("td.repeats").inner_text() == "2"
        assert row.locator("td.mean-se").inner_text() == "100.0% ± 0.0"
        assert row.locator("td.pass-at-k").inner_text() == "pass@2 100.0%"
        assert row.locator("td.pass-hat-k").inner_text() == "pass^2 100.0%"
        assert row.locator("td.flip-rate").inner_text().startswith("0.0%")
        noop = page.locator("#leaderboard tbody tr", has_text="noop-x1")
        assert noop.locator("td.repeats").inner_text() == "1"  # one repeat; no repeat numbers
        assert noop.locator("td.mean-se").count() == 0

        page.click("#leaderboard a:text('replay-x2')")  # the run page: every repeat, labelled
        page.wait_for_selector("#tasks tbody tr")
        assert page.locator("#tasks tbody tr").count() == 6
        assert page.locator("#tasks .tag.repeat").all_inner_texts().count("#2") == 3
        assert "pass@2 100.0%" in page.locator("dd.repeats").inner_text()
        page.goto("/ui/runs")
        page.select_option("select[name=a]", "noop-x1")
        page.select_option("select[name=b]", "replay-x2")
        page.click("form.compare button")
        page.wait_for_selector("#paired-test")
        assert "not significant at 0.05" in page.locator("#paired-test .verdict").inner_text()
        assert page.locator("#paired-test .p-value").inner_text() == "p = 0.25"
        assert page.locator("#paired-test .mean-diff").inner_text() == "+100.0 points"
        assert page.locator("#flipped tbody tr.gained").count() == 3
        assert "2/2" in page.locator("#flipped tbody tr.gained").first.inner_text()
        page.context.close()
