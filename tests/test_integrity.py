"""Integrity checks and input errors, without training:

- the array digest (edm2_jax/run/integrity.py) is the same computed jitted or in NumPy, for
  every dtype a train state holds, and changes with any one flipped element;
- NaN/inf is found by both;
- every bad input that needs no run is refused with a message
  naming the problem and the fix, before anything is written or compiled.
The runs with faults injected (byte flips, concurrent trainers, NaN, disk full, all
checkpoints corrupt, the CLI's messages) are in tests/test_fault_tolerance.py.
"""
from __future__ import annotations

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edm2_jax.run import network_dir as ckpt_lib
from edm2_jax import configs, nets
from edm2_jax.release import convert
from edm2_jax.evaluation import commands as eval_commands
from edm2_jax.evaluation import images as eval_images
from edm2_jax.run import integrity
from edm2_jax.evaluation import fid


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 5, 7)).astype(np.float32),
        "big": rng.standard_normal(3 * (1 << 20) + 17).astype(np.float32),  # > one NumPy chunk
        "bf16": jnp.asarray(rng.standard_normal(33), jnp.bfloat16),
        "i32": np.int32(7),
        "u32": rng.integers(0, 2**32, (2,), dtype=np.uint32),
        "bool": rng.random(9) > 0.5,
    }


def test_digest_jitted_equals_numpy_for_every_dtype():
    tree = _arrays()
    jitted = integrity.digest_tree(jax.tree.map(jnp.asarray, tree), jitted=True)
    host = integrity.digest_tree_numpy(jax.tree.map(np.asarray, tree))
    assert jitted["digests"] == host["digests"]
    assert integrity.digest_tree(jax.tree.map(jnp.asarray, tree))["digests"] == host["digests"]
    assert len(set(map(tuple, host["digests"].values()))) == len(tree)  # all distinct
    # A typed PRNG key is digested as its key data (what Orbax saves and reads back).
    key = jax.random.key(0, impl="rbg")
    for jitted in (True, False):
        assert integrity.digest_tree({"k": key}, jitted=jitted)["digests"] == \
            integrity.digest_tree_numpy({"k": np.asarray(jax.random.key_data(key))})["digests"]


def test_digest_changes_with_any_one_flipped_element_and_only_then():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    base, _ = integrity.digest_numpy(x)
    assert integrity.digest_numpy(x.copy())[0] == base  # negative control
    rng = np.random.default_rng(2)
    for pos in rng.integers(0, x.nbytes, 200):
        for mask in (0x01, 0x80, 0xFF):
            y = x.copy()
            y.view(np.uint8)[pos] ^= mask
            assert integrity.digest_numpy(y)[0] != base, (pos, mask)
    # Two elements swapped (same multiset of values) are told apart too.
    y = x.copy()
    y[[10, 20]] = y[[20, 10]]
    assert integrity.digest_numpy(y)[0] != base


def test_nonfinite_found_jitted_and_in_numpy():
    for bad in (np.nan, np.inf, -np.inf):
        tree = {"ok": np.ones(3, np.float32), "bad": np.array([1, bad, 2], np.float32),
                "h": np.array([1, bad], np.float16)}
        for jitted in (True, False):
            assert integrity.digest_tree(jax.tree.map(jnp.asarray, tree),
                                         jitted=jitted)["nonfinite"] == ["bad", "h"]
        assert integrity.digest_tree_numpy(tree)["nonfinite"] == ["bad", "h"]
    with pytest.raises(integrity.IntegrityError, match="non-finite.*bad"):
        integrity.check(None, integrity.digest_tree_numpy(tree), "x")


def test_check_names_the_arrays_that_differ():
    tree = {"a": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}
    record = integrity.digest_tree_numpy(tree)
    integrity.check(record, integrity.digest_tree_numpy(tree), "x")
    tree["b"][1] = 1e-30
    with pytest.raises(integrity.IntegrityError, match=r"1 array\(s\) differ.*checksum.*: b"):
        integrity.check(record, integrity.digest_tree_numpy(tree), "x")


# --------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize("field,value,match", [
    ("batch_size", 0, r"--config\.batch_size=0: the global batch must be a positive"),
    ("total_kimg", 0, r"--config\.total_kimg=0\.0: must be a positive number of kimg"),
    ("total_kimg", -5.0, r"--config\.total_kimg=-5\.0: must be a positive"),
    ("checkpoint_kimg", 0.0, r"--config\.checkpoint_kimg=0\.0: must be a positive"),
    ("keep_checkpoints", 0, r"--config\.keep_checkpoints=0: keep at least 1"),
    ("resume_step", -2, r"--config\.resume_step=-2: a checkpoint step"),
])
def test_config_that_cannot_train_is_refused_naming_field_and_fix(field, value, match):
    c = configs.base_config()
    c[field] = value
    with pytest.raises(ValueError, match=match):
        configs.validate(c)


def test_convert_of_a_non_pickle_names_the_file_and_the_formats(tmp_path):
    src = tmp_path / "random.pkl"
    src.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    with pytest.raises(ValueError, match=rf"{src} is not a file this converter reads.*"
                                         r"edm2-\*\.pkl.*\.npz"):
        convert.convert(str(src), str(tmp_path / "net"))
    assert not (tmp_path / "net").exists()


def test_convert_into_a_training_run_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    src = tmp_path / "w.npz"
    np.savez(src, x=np.zeros(1))
    with pytest.raises(FileExistsError, match="is a training run directory.*another --workdir"):
        convert.convert(str(src), str(run))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]


@pytest.mark.parametrize("suffix", [".pkl", ".npz"])
def test_garbage_reference_statistics_name_the_file(tmp_path, suffix):
    ref = tmp_path / f"ref{suffix}"
    ref.write_bytes(b"\x80\x04garbage" * 50)
    with pytest.raises(ValueError, match=rf"reference statistics file {ref} is unreadable.*"
                                         r"re-download or recompute"):
        fid.load_ref_stats(ref)


def test_eval_refuses_bad_inputs_before_generating(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_images, "net_images", lambda *a, **k: pytest.fail("generated"))
    kw = dict(images_dir=None, net_path="nets/x", metrics="fid", data_config=None)
    with pytest.raises(ValueError, match=r"--num_images=0: the metrics need at least 2"):
        eval_commands.main_eval(num_images=0, ref=None, **kw)
    ref = tmp_path / "bad.pkl"
    ref.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match=rf"{ref} has no 'fid' statistics"):
        eval_commands.main_eval(num_images=10, ref=str(ref), **kw)


def test_generate_refuses_a_directory_that_is_both_run_and_network(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / ckpt_lib.VARIABLES).mkdir()
    (d / "config.json").write_text("{}")
    (d / ckpt_lib.NETWORK_JSON).write_text('{"network": {}}')
    with pytest.raises(ValueError, match="both a training run and a network checkpoint.*move"):
        nets.load_net(str(d))


def test_network_json_unreadable_is_an_integrity_error(tmp_path):
    (tmp_path / ckpt_lib.NETWORK_JSON).write_bytes(b"{\"netw\xff\xfe")
    with pytest.raises(integrity.IntegrityError, match="unreadable.*write that network"):
        ckpt_lib.read_network_json(str(tmp_path))
    assert os.path.isfile(tmp_path / ckpt_lib.NETWORK_JSON)
