"""The 2D toy distilled into few steps (edm2_jax/toy/distill.py): multistep
consistency distillation (Heek et al. 2024, arXiv:2403.06807) of the toy's denoiser into
1, 2, 4 and 8-step students, and the 1, 2, 4-step generators of distribution matching
without and with DMD2's GAN head (edm2_jax/toy/dmd.py), on the tiny setting
(`DistillSettings.tiny`), run once through the CLI."""
import json
import os

import jax
import matplotlib.image
import numpy as np
import pytest

from edm2_jax.toy import distill as toy_distill

# Slow: every test reads the one tiny distillation run (~80 s on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.ci]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python -m edm2_jax.toy.distill --out=... --tiny`: the teacher trained,
    four students and six generators distilled, fifteen sample sets measured, the
    figure drawn."""
    out = str(tmp_path_factory.mktemp("toy_distill"))
    return toy_distill.main([f"--out={out}", "--tiny"])


def test_a_student_starts_as_its_teacher(tiny_run):
    # Before its first step a student is the teacher's net with the teacher's weights, so
    # its K-step sampler is the teacher's DDIM over the same K segments.
    net, teacher = tiny_run["teacher"]
    students, losses = toy_distill.distill_students(net, teacher, tiny_run["mix"],
                                                    toy_distill.DistillSettings.tiny(),
                                                    steps=0)
    toy = toy_distill.DistillSettings.tiny().toy
    x = toy_distill.consistency_points(net, students[4], toy.num_samples, num_steps=4,
                                       teacher_steps=toy.num_steps)
    np.testing.assert_allclose(x, tiny_run["samples"]["ddim_4"], atol=1e-4)
    assert all(v.shape == (0,) for v in losses.values())


def test_distillation_lowers_every_students_loss(tiny_run):
    for K in (1, 2, 4, 8):
        loss = tiny_run["losses"][K]
        assert loss[-32:].mean() < 0.5 * loss[:32].mean(), (K, loss[:32].mean(),
                                                            loss[-32:].mean())


def test_students_beat_the_teachers_ddim_at_the_same_steps(tiny_run):
    # The student is trained to land, in K evaluations, where the teacher's Heun steps
    # land; the teacher's own K-step DDIM smears the samples between the branches and
    # piles them on the trunk, the more so the fewer the steps.
    # Margins: about half the smallest gain over seeds 0, 1, 2 (on branches: 0.38, 0.12,
    # 0.034, 0.010 at K = 1, 2, 4, 8; coverage: 0.71, 0.22, 0.12, 0.049).
    m = tiny_run["metrics"]
    on_branches = {1: 0.2, 2: 0.06, 4: 0.015, 8: 0.0}
    coverage = {1: 0.35, 2: 0.1, 4: 0.06, 8: 0.02}
    for K in (1, 2, 4, 8):
        student, ddim = m[f"student_{K}"], m[f"ddim_{K}"]
        assert student["on_branches"] > ddim["on_branches"] + on_branches[K], (K, student, ddim)
        assert student["coverage"] > ddim["coverage"] + coverage[K], (K, student, ddim)
    assert tiny_run["evaluations"]["student_4"] == 4 and tiny_run["evaluations"]["heun"] == 31


def test_a_students_point_is_near_the_teachers_heun_point_from_the_same_noise(tiny_run):
    # What distillation aims at: the student's K-step map from noise to a point is the
    # teacher's probability-flow ODE map (its Heun sampler's, 2N - 1 evaluations). The
    # teacher's own K-step DDIM is far from it; the student within a third of that (over
    # seeds 0, 1, 2 the ratio is at most 0.18).
    d = tiny_run["to_heun"]
    for K in (1, 2, 4, 8):
        assert d[f"student_{K}"] < 0.3 * d[f"ddim_{K}"], (K, d)
    assert d["ddim_1"] > 0.2, d   # DDIM in one step: the class's mean, not a sample


def test_more_steps_make_a_better_student(tiny_run):
    m = tiny_run["metrics"]
    on = [m[f"student_{K}"]["on_branches"] for K in (1, 2, 4, 8)]
    assert on == sorted(on), on


def test_run_writes_the_figure_metrics_and_samples(tiny_run):
    out = os.path.dirname(tiny_run["plot"])
    assert os.path.getsize(tiny_run["plot"]) > 10_000
    saved = json.load(open(os.path.join(out, "metrics.json")))
    assert set(saved["metrics"]) == set(tiny_run["samples"])
    for name, m in tiny_run["metrics"].items():
        assert saved["metrics"][name] == pytest.approx(m), name
    assert saved["to_heun"] == pytest.approx(tiny_run["to_heun"])
    assert saved["grid"]["teacher_steps"] == 16
    with np.load(os.path.join(out, "samples.npz")) as f:
        for name, x in tiny_run["samples"].items():
            np.testing.assert_array_equal(f[name], x)


def test_students_and_their_points_depend_only_on_the_seed(tiny_run):
    # Distilling again with the run's seed gives the same students bit for bit, and
    # sampling them again from the same noise seed the same points.
    net, teacher = tiny_run["teacher"]
    settings = toy_distill.DistillSettings.tiny()
    students, _ = toy_distill.distill_students(net, teacher, tiny_run["mix"], settings,
                                               seed=100)
    for K, variables in students.items():
        for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(tiny_run["students"][K])):
            np.testing.assert_array_equal(a, b)
    n = settings.toy.num_samples
    x = toy_distill.consistency_points(net, students[2], n, num_steps=2, teacher_steps=16,
                                       seed=1)
    np.testing.assert_array_equal(x, tiny_run["samples"]["student_2"])
    y = toy_distill.consistency_points(net, students[2], n, num_steps=2, teacher_steps=16,
                                       seed=2)
    assert np.abs(x - y).max() > 0.1


def test_distribution_matching_generators_beat_the_teachers_ddim(tiny_run):
    # Distribution matching (toy.dmd, DMD2 without its GAN head) trains each generator to
    # sample the class's density, not the teacher's ODE map: in 1 evaluation its points
    # lie on the branches and cover them where the teacher's DDIM averages them onto the
    # trunk (at 1024 steps, seed 0: on branches 0.71 against 0.002, coverage 0.95 against
    # 0.12). In 2 evaluations more of its points are on the branches than DDIM's, but they
    # cover less of them (seed 0: on branches 0.67 against 0.46, coverage 0.53 against
    # 0.72): the reverse KL it descends seeks modes.
    m = tiny_run["metrics"]
    gen, ddim = m["dmd_1"], m["ddim_1"]
    assert gen["on_branches"] > ddim["on_branches"] + 0.2, (gen, ddim)
    assert gen["coverage"] > ddim["coverage"] + 0.3, (gen, ddim)
    assert m["dmd_2"]["on_branches"] > m["ddim_2"]["on_branches"] + 0.1, m
    assert set(tiny_run["generators"]) == {1, 2, 4}
    assert tiny_run["evaluations"]["dmd_1"] == 1


def test_the_gan_heads_generators_are_a_row_of_their_own(tiny_run):
    # The same generators as distribution matching's, trained with DMD2's GAN head: their
    # samples, metrics and evaluations, their losses with the head's columns, and a
    # fourth row of the figure (4.5 inches a row at 80 dpi).
    assert set(tiny_run["gan_generators"]) == {1, 2, 4}
    for K in (1, 2, 4):
        assert tiny_run["evaluations"][f"dmd_gan_{K}"] == K
        assert tiny_run["losses"][f"dmd_gan_{K}"].shape == (512, 6)
        assert tiny_run["losses"][f"dmd_{K}"].shape == (512, 2)
    assert set(tiny_run["metrics"]) >= {"dmd_gan_1", "dmd_gan_2", "dmd_gan_4"}
    saved = json.load(open(os.path.join(os.path.dirname(tiny_run["plot"]), "metrics.json")))
    assert saved["metrics"]["dmd_gan_1"] == pytest.approx(tiny_run["metrics"]["dmd_gan_1"])
    assert len(saved["final_loss"]["dmd_gan_1"]) == 6
    assert matplotlib.image.imread(tiny_run["plot"]).shape[0] == 4 * 4.5 * 80


def test_the_gan_heads_classifier_tells_real_points_from_generated_ones_at_the_start(
        tiny_run):
    # The classifier on the teacher's last hidden layer scores the mixture's points above
    # the 1-step generator's in its first steps (sigmoid of the real minus that of the
    # generated points over the first 32 steps, seeds 0, 1, 2: 0.065, 0.12, 0.079). By
    # the end it is at chance (2 ln 2; the last 32 steps: 1.384 to 1.385): the
    # generator has drawn near the data where the teacher's features tell them apart.
    _, loss_cls, real_prob, fake_prob = tiny_run["losses"]["dmd_gan_1"][:, 2:].T
    assert real_prob[:32].mean() - fake_prob[:32].mean() > 0.03
    assert abs(loss_cls[-32:].mean() - 2 * np.log(2)) < 0.01, loss_cls[-32:].mean()


def test_the_gan_head_puts_the_1_step_generators_points_nearer_the_branches(tiny_run):
    # With the head (DMD2's GAN term, on the teacher's features) the 1-step generator
    # has at least distribution matching's on-branch fraction and a higher mean log p
    # (seeds 0, 1, 2: on branches +0.062, +0.005, +0.050; log p +0.41, +0.98, +2.62;
    # coverage -0.014, -0.014, +0.021, not asserted). Both beat the teacher's 1-step
    # DDIM by far (on branches 0.66 to 0.72 against 0.002 to 0.09, coverage 0.89 to
    # 0.94 against 0.12 to 0.26).
    m = tiny_run["metrics"]
    gen, plain, ddim = m["dmd_gan_1"], m["dmd_1"], m["ddim_1"]
    assert gen["on_branches"] >= plain["on_branches"], (gen, plain)
    assert gen["mean_logp"] > plain["mean_logp"], (gen, plain)
    assert gen["on_branches"] > ddim["on_branches"] + 0.3, (gen, ddim)
    assert gen["coverage"] > ddim["coverage"] + 0.4, (gen, ddim)
