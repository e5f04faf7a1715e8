"""Grid files: product and zipped axes, baseline pairing and run names, and every refusal (one
message naming the file and the entry) before anything runs."""
import pytest

from lrmoe.ablate.grid import GridError, load_grid, parse_grid
from lrmoe.ablate.runner import GRIDS_DIR
from lrmoe.scorers import register_scorer, unregister_scorer

HEAD = {"question": "q?", "preset": "smoke"}


def grid(**sections):
    return parse_grid({"grid": dict(HEAD, **sections.pop("grid", {})), **sections}, "t.toml")


def names(g):
    return [c.name for c in g.cells]


def test_product_axes_and_baselines():
    g = grid(axes={"seed": [0, 1], "drop_ratio": [0.2, 0.5], "scorer": ["lrm", "random"]})
    variants = [c for c in g.cells if not c.is_baseline]
    assert len(variants) == 8 and len(g.cells) == 10  # 2 x 2 x 2, one C0 per seed
    assert names(g)[:2] == ["qwen3-C00-s0", "qwen3-C00-s1"]  # baselines first
    c = g.cell("qwen3-C50-random-s1")
    assert c.baseline == "qwen3-C00-s1" and c.coords == {"seed": 1, "drop_ratio": 0.5, "scorer": "random",
                                                         "family": "qwen3"}
    base = next(r for r in g.runs() if r.name == "qwen3-C00-s1").config
    assert base["drop_ratio"] == 0.0 and base["scorer"] == "lrm" and base["seed"] == 1  # selection at the preset's
    run = next(r for r in g.runs() if r.name == "qwen3-C50-random-s1").config
    assert {k: v for k, v in run.items() if run[k] != base[k]} == {"drop_ratio": 0.5, "scorer": "random"}
    assert run["model"] == "qwen3-moe-tiny" and run["steps"] == 30  # the smoke preset's


def test_zip_groups_and_families_and_set():
    g = grid(set={"steps": 4}, axes={"family": ["qwen3", "glm4"], "drop_ratio": [0.5]},
             zip=[{"mode": ["compact", "mask"], "quota": ["waterfill", "proportional"]}])
    variants = [c.name for c in g.cells if not c.is_baseline]
    assert variants == ["qwen3-C50-lrm-compact-waterfill-s0", "qwen3-C50-lrm-mask-proportional-s0",
                        "glm4-C50-lrm-compact-waterfill-s0", "glm4-C50-lrm-mask-proportional-s0"]
    assert g.cell("glm4-C50-lrm-mask-proportional-s0").baseline == "glm4-C00-s0"
    assert all(r.config["steps"] == 4 for r in g.runs())
    assert next(r for r in g.runs() if r.family == "glm4").config["model"] == "glm4-moe-tiny"


def test_a_baseline_at_the_same_drop_ratio_and_a_run_that_is_its_own_baseline():
    g = grid(set={"drop_ratio": 0.5}, axes={"mode": ["compact", "mask"]}, baseline={"mode": "compact"})
    assert names(g) == ["qwen3-C50-lrm-compact-s0", "qwen3-C50-lrm-mask-s0"]
    assert g.cell("qwen3-C50-lrm-mask-s0").baseline == "qwen3-C50-lrm-compact-s0"
    g = grid(axes={"drop_ratio": [0.0, 0.3], "scorer": ["lrm", "random"]})  # both C0 combinations: one run
    assert names(g) == ["qwen3-C00-s0", "qwen3-C30-lrm-s0", "qwen3-C30-random-s0"]


def test_a_registered_scorer_is_accepted_while_it_is_registered():
    register_scorer("test_ablate_scorer", lambda ctx: ctx.alpha.abs())
    try:
        g = grid(axes={"drop_ratio": [0.5], "scorer": ["lrm", "test_ablate_scorer"]})
        assert "qwen3-C50-test_ablate_scorer-s0" in names(g)
    finally:
        unregister_scorer("test_ablate_scorer")
    with pytest.raises(GridError, match=r"t.toml: \[axes\] scorer = 'test_ablate_scorer': unknown scorer"):
        grid(axes={"drop_ratio": [0.5], "scorer": ["lrm", "test_ablate_scorer"]})


@pytest.mark.parametrize("doc, message", [
    ({"grid": HEAD, "axis": {}}, r"unknown section\(s\) \['axis'\]"),
    ({"axes": {"seed": [0]}}, r"no \[grid\] table"),
    ({"grid": dict(HEAD, colour="red")}, r"\[grid\] 'colour' is not a grid setting"),
    ({"grid": {"preset": "smoke"}}, r"\[grid\] question must be"),
    ({"grid": dict(HEAD, preset="huge")}, r"\[grid\] preset = 'huge': unknown preset; accepted: smoke"),
    ({"grid": dict(HEAD, metrics=["ppl"])}, r"\[grid\] metrics: unknown metric 'ppl'; accepted: .*dppl_final"),
    ({"grid": dict(HEAD, jobs=0)}, r"\[grid\] jobs = 0"),
    ({"grid": HEAD, "axes": {"scorr": ["lrm"]}}, r"\[axes\] unknown option 'scorr'; accepted: family and .*scorer"),
    ({"grid": HEAD, "axes": {"profile": [True, False]}},
     r"\[axes\] 'profile' is an option of BackwardPolicy but not of training"),
    ({"grid": HEAD, "set": {"data": "x.json"}}, r"\[set\] 'data' cannot be set by a grid"),
    ({"grid": HEAD, "axes": {"model": ["qwen3-moe-tiny"]}}, r"\[axes\] 'model': a grid chooses models by family"),
    ({"grid": HEAD, "axes": {"scorer": ["lrm", "nope"]}}, r"\[axes\] scorer = 'nope': unknown scorer 'nope'"),
    ({"grid": HEAD, "axes": {"quota": ["fair"]}}, r"\[axes\] quota = 'fair': unknown quota policy 'fair'"),
    ({"grid": HEAD, "axes": {"drop_ratio": [1.5]}}, r"\[axes\] drop_ratio = 1.5: .*drop_ratio"),
    ({"grid": HEAD, "axes": {"family": ["llama"]}}, r"\[axes\] family 'llama': not a family of preset 'smoke'"),
    ({"grid": HEAD, "axes": {"drop_ratio": []}}, r"\[axes\] drop_ratio = \[\]: an empty axis makes the grid empty"),
    ({"grid": HEAD, "axes": {"drop_ratio": 0.2}}, r"\[axes\] drop_ratio = 0.2: an axis is a list"),
    ({"grid": HEAD, "axes": {"seed": [0, 0]}}, r"\[axes\] seed: the value 0 is listed twice"),
    ({"grid": HEAD, "zip": [{"mode": ["compact", "mask"], "drop_ratio": [0.2]}]},
     r"\[\[zip\]\] group 1: zipped axes must be lists of one length"),
    ({"grid": HEAD, "zip": [{"drop_ratio": [0.2, 0.2], "scorer": ["lrm", "lrm"]}]},
     r"\[\[zip\]\] group 1: the combination drop_ratio, scorer = \(0.2, 'lrm'\) is listed twice"),
    ({"grid": HEAD, "set": {"scorer": "lrm"}, "axes": {"scorer": ["random"]}},
     r"\[axes\] 'scorer' is also given in \[set\]"),
    ({"grid": HEAD, "axes": {"mode": ["full", "compact"], "drop_ratio": [0.2]}},
     r"run mode='full' x drop_ratio=0.2: mode 'full' keeps every pair"),
    ({"grid": HEAD, "axes": {"drop_ratio": [0.2]}, "baseline": {"seed": 1}},
     r"\[baseline\] 'seed': a run is paired with the baseline of its own seed"),
    ({"grid": HEAD, "axes": {"drop_ratio": [0.2]}, "baseline": {"mode": "full", "drop_ratio": 0.2}},
     r"\[baseline\] of run drop_ratio=0.2: mode 'full' keeps every pair"),
    ({"grid": HEAD, "axes": {"seed": [0, 1]}}, r"every run of the grid is its own baseline"),
    ({"grid": HEAD, "axes": {"drop_ratio": [0.2], "policy_seed": [-1]}},
     r"\[axes\] policy_seed = -1: policy_seed must be an integer >= 0"),
])
def test_bad_grids_are_refused_naming_the_entry(doc, message):
    with pytest.raises(GridError, match=r"^t\.toml: " + message):
        parse_grid(doc, "t.toml")


def test_bad_files(tmp_path):
    (tmp_path / "bad.toml").write_text("[grid\nquestion = 1")
    with pytest.raises(GridError, match=r"bad.toml: not a TOML file"):
        load_grid(tmp_path / "bad.toml")
    with pytest.raises(GridError, match=r"'.*none.toml' does not exist"):
        load_grid(tmp_path / "none.toml")


def test_the_kits_grids_parse():
    for path in sorted(GRIDS_DIR.glob("*.toml")):
        g = load_grid(path)
        assert g.cells and any(not c.is_baseline for c in g.cells) and g.question and g.cost
        assert all(c.baseline in {x.name for x in g.cells} for c in g.cells)
    paper = load_grid(GRIDS_DIR / "paper.toml")
    assert paper.launcher == "torchrun" and paper.nproc == 8 and len(paper.cells) == 78
    phi = load_grid(GRIDS_DIR / "phi.toml")
    assert {r.config["phi"] for r in phi.runs()} == {"h", "x", "both"}
    assert {r.config["selection"] for r in load_grid(GRIDS_DIR / "unbiased.toml").runs()} == {"top", "sample"}


def test_a_zipped_axis_may_repeat_a_value():
    """T1's drop levels and T2's scorers at C20 in one zip: drop_ratio 0.2 three times, each with its
    own scorer, every run with its own name and the shared C0 baseline of its seed."""
    g = parse_grid({"grid": HEAD, "axes": {"seed": [0]},
                    "zip": [{"drop_ratio": [0.1, 0.2, 0.2], "scorer": ["lrm", "lrm", "random"]}]}, "t.toml")
    variants = [c for c in g.cells if not c.is_baseline]
    assert len(variants) == len({c.name for c in variants}) == 3
    assert {c.baseline for c in variants} == {next(c.name for c in g.cells if c.is_baseline)}
