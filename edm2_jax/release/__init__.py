"""The authors' PyTorch release's file formats and random draws, read and written without
its code: network pickles and state dicts into our networks and back, its training states
into our runs, its per-seed torch draws in NumPy.

    unpickler.py       the globals the release's files hold (`RELEASE_GLOBALS`), each a
                       constructor of data; `ReleaseUnpickler` refuses any other;
                       `torch_load` of `torch.save` files
    pickle_io.py       which network a file holds and its kwargs: `load_release`
    convert.py         release <-> our keys and layouts, the architecture from shapes,
                       `convert` (a release network into a network checkpoint)
    training_state.py  reading a release training state `training-state-*.pt`
    export.py          our networks as the release's network pickles
    rng.py             the release's per-seed draws (noise, class, churn)
"""
