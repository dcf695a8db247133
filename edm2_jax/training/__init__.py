"""Training: the train state, the step, and the loop that runs it in a run directory.

    state.py          `make_network`, `init_train_state` (the train state pytree)
    step.py           `make_train_step` (loss, gradients, Adam, EMAs), `jit_train_step`
    optim.py          Adam with the inverse-sqrt learning rate, clipping, forced weight norm
    sharding.py       device mesh, shardings, multi-host set-up
    setup.py          the loop's set-up steps: data, evaluation, model, restore or init
    progress.py       the loop's schedule, its metrics and status lines
    snapshot_outputs.py  what a snapshot makes besides the EMAs: the sample grid and the
                      evaluation during training (`TrainingEval`)
    loop.py           `train_and_evaluate`
    resume.py         which config fields may change when a run resumes; the rescue
                      advice after a divergence
    preemption.py     stopping at the same step on every process after a signal
    probes.py         training-dynamics probes logged at every status line
    from_release.py   a release training state as our train state
"""
