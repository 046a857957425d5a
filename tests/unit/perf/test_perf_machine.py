"""Machine profiles: the shipped ones load with every number cited; bad JSON is refused by key."""

from __future__ import annotations

import copy
import json

import pytest

from thdpack.perf.machine import PROFILE_NAMES, MachineProfile, load_profile


def _h100() -> dict:
    return load_profile("h100_sxm").to_dict()


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_shipped_profiles_load_and_cite_every_number(name):
    profile = load_profile(name)
    assert profile.name == name
    cited = {key for source in profile.sources for key in source.keys}
    assert {"peak_flops", "attention.forward_causal", "intra_node.latency_s", "collective_factors.all_to_all"} <= cited
    for source in profile.sources:
        assert source.source and source.where
    # the curves rise with length (short chunks run below the long-sequence rate)
    rates = [r for _, r in profile.attention.forward_causal]
    assert rates == sorted(rates) and rates[-1] <= profile.peak_flops


def test_the_expected_machines_ship():
    assert set(PROFILE_NAMES) == {"h100_sxm", "h200_sxm", "a100_sxm_80gb", "gb200_nvl72", "cpu_gloo"}
    gb200, h100 = load_profile("gb200_nvl72"), load_profile("h100_sxm")
    assert (gb200.gpus_per_node, gb200.nvlink_domain) == (4, 72)  # NVLink across the trays
    assert (h100.gpus_per_node, h100.nvlink_domain) == (8, 8)
    assert h100.peak_flops == 989.5e12 and h100.inter_node.bandwidth == 50e9
    cpu = load_profile("cpu_gloo")
    assert all("placeholder" in s.source for s in cpu.sources[:1]) and "calibrate" in cpu.sources[0].where


def test_round_trip_through_json(tmp_path):
    profile = load_profile("a100_sxm_80gb")
    profile.to_json(tmp_path / "mine.json")
    again = load_profile(tmp_path / "mine.json")
    assert again == profile


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(peak_flopz=1.0), "unknown key 'peak_flopz'"),
        (lambda d: d["attention"].update(tiles=128), "unknown key 'attention.tiles'"),
        (lambda d: d["intra_node"].update(bandwith=1.0), "unknown key 'intra_node.bandwith'"),
        (lambda d: d.pop("memory_bandwidth"), "missing key 'memory_bandwidth'"),
        (lambda d: d.update(peak_flops=float("nan")), "'peak_flops' must be a finite number > 0, got nan"),
        (lambda d: d.update(peak_flops=float("inf")), "'peak_flops' must be a finite number > 0, got inf"),
        (lambda d: d["inter_node"].update(latency_s=-1e-6), "'inter_node.latency_s' must be a finite number >= 0"),
        (lambda d: d.update(matmul_efficiency=1.2), "'matmul_efficiency' is a fraction of the peak"),
        (lambda d: d.update(gpus_per_node=True), "'gpus_per_node' must be a number, got True"),
        (lambda d: d.update(gpus_per_node=3), "nvlink_domain=8 is not a multiple of gpus_per_node=3"),
        (lambda d: d["attention"].update(backward=[[1024, 1e12], [512, 2e12]]), "'attention.backward' lengths"),
        (lambda d: d["attention"]["forward_full"].__setitem__(0, [512, -1.0]), "'attention.forward_full[0].flops'"),
        (lambda d: d["collective_factors"].pop("all_to_all"), "missing key 'collective_factors.all_to_all'"),
        (lambda d: d["sources"][0].update(page=3), "unknown key 'sources[0].page'"),
    ],
)
def test_bad_profiles_are_refused_naming_the_key(edit, message):
    data = copy.deepcopy(_h100())
    edit(data)
    with pytest.raises(ValueError) as err:
        MachineProfile.from_dict(data)
    assert str(err.value).startswith("profile 'h100_sxm': ") and message in str(err.value)


def test_an_uncited_number_is_refused():
    data = _h100()
    data["sources"] = [s for s in data["sources"] if "matmul_efficiency" not in s["keys"]]
    with pytest.raises(ValueError, match="'matmul_efficiency' cites no source"):
        MachineProfile.from_dict(data)
    data = _h100()
    data["sources"][0]["keys"].append("peak_flopz")
    with pytest.raises(ValueError, match="sources cite 'peak_flopz', which is not a number of the profile"):
        MachineProfile.from_dict(data)


def test_files_that_are_not_profiles(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        load_profile(tmp_path / "list.json")
    with pytest.raises(ValueError, match="unknown profile 'b300'"):
        load_profile("b300")


def test_the_model_imports_without_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import thdpack.perf.step, thdpack.perf.megatron, thdpack.perf.modes, thdpack.perf.suggest\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
