"""A config holds what its run reads: its objective's section and no other
(`configs.with_objective`), and a resume compares the fields its objective reads, so a
run whose config.json holds another objective's section (or fields of a section another
objective shares) resumes unchanged."""
from __future__ import annotations

from edm2_jax import configs, objectives
from edm2_jax.objectives import distill, dmd
from edm2_jax.training import resume


def test_a_config_holds_only_its_objectives_section():
    c = configs.base_config()
    assert "distill" not in c and c.objective == "edm2" and tuple(c.plugins) == ()
    configs.with_objective(c, "consistency")
    assert set(c.distill) == set(distill.DISTILL_FIELDS)
    c.distill.steps = 2
    configs.with_objective(c, "dmd")   # a shared section keeps its values, gains DMD's
    assert set(c.distill) == set(dmd.DistributionMatching.section_fields())
    assert c.distill.steps == 2 and c.objective == "dmd"
    assert objectives.record(c.to_dict())["distill"]["steps"] == 2


def test_resume_compares_the_fields_the_objective_reads():
    """An EDM2 run whose config.json carries a `distill` section (written when every
    config held every section) resumes under a config without it; a consistency run
    whose section holds DMD's fields too resumes; a changed field it reads is refused."""
    old = configs.base_config().to_dict()
    current = configs.base_config().to_dict()
    old["distill"] = dmd.DistributionMatching.section_fields()
    assert resume.config_differences(old, current) == ([], [])
    student = configs.with_objective(configs.base_config(), "consistency").to_dict()
    saved = dict(student, distill=dict(old["distill"], **student["distill"]))
    assert resume.config_differences(saved, student) == ([], [])
    changed = dict(student, distill=dict(student["distill"], steps=3))
    refused, _ = resume.config_differences(saved, changed)
    assert refused == [f"distill.steps: checkpoint {student['distill']['steps']!r} vs now 3"]
    refused, _ = resume.config_differences(saved, current)
    assert refused == ["objective: checkpoint 'consistency' vs now 'edm2'"]
