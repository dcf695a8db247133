"""The paper's ablation, configs C-G (Karras et al. 2024, Sec. 2, Table 1), on any data.

    python -m edm2_jax.main --config=configs/ablation.py:c --workdir=runs/abl-c
    python -m edm2_jax.main --config=configs/ablation.py:g,tiny --workdir=/tmp/abl-g
    python -m edm2_jax.main --config=configs/ablation.py:e,img64-s --workdir=runs/e64 \
        --config.data.source=folder --config.data.path=img64.zip

Variant `LETTER[,BASE]`: LETTER in c, d, e, f, g; BASE is `fashion_mnist` (default),
`tiny` (its seconds-long smoke size) or a released preset of `presets.py` (`img64-s`,
...); any other dataset through the usual `--config.data.*` flags. Each letter turns the
switches of the later configs off, one field per step (docs/ablation.md):

    G  the default network and training (configs/fashion_mnist.py; the release)
    F  network.mp_fixed_layers=False     SiLU, plain sum/concat, cos Fourier, no gains
    E  + network.group_norm=True         group norm in the blocks, no pixel norm;
       + network.res_balance=0.5         the residual path not weakened (F, G: 0.3)
    D  + optim.forced_wn=False           plain Adam on the unnormalised stored weights;
       + optim.t_ref=0                   no inverse-sqrt learning-rate decay
    C  + network.mp_learned_layers=False standard layers, He uniform init;
       + optim.ref_lr=ref_lr/10          the standard weights are ~10x smaller than the
                                         unit-RMS ones of D-G (sqrt(2/fan_in) = 0.03-0.12
                                         here), so Adam's steps keep about the same
                                         relative size at the start

What is no switch: the EDM2 loss with learned uncertainty, the noise distribution, the
power EMAs, cosine attention and bias-free layers with a constant input channel are
config G's in every letter (the paper brought them in at B and C).
"""
import os

from edm2_jax import configs

LETTERS = "cdefg"


def _fashion_mnist_config(variant: str):
    return configs.config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "fashion_mnist.py"), variant)


def get_config(variant: str = "g"):
    letter, _, base = (variant or "g").partition(",")
    letter, base = letter.strip().lower(), base.strip() or "fashion_mnist"
    if len(letter) != 1 or letter not in LETTERS:
        raise ValueError(f"configs/ablation.py: unknown variant {variant!r}; use one of "
                         f"{', '.join(LETTERS)}, optionally followed by ',tiny' or ',<preset>' "
                         f"(e.g. 'c,tiny', 'e,img64-s')")
    if base in ("fashion_mnist", "tiny"):
        c = _fashion_mnist_config("tiny" if base == "tiny" else "default")
    else:
        c = configs.preset_config(base)
    if letter <= "f":
        c.network.mp_fixed_layers = False
    if letter <= "e":
        c.network.group_norm = True
        c.network.res_balance = 0.5
    if letter <= "d":
        c.optim.forced_wn = False
        c.optim.t_ref = 0
    if letter <= "c":
        c.network.mp_learned_layers = False
        c.optim.ref_lr = c.optim.ref_lr / 10
    return c
