"""The flax and Orbax integrations, loaded on first use (``import fxaccum`` loads neither).

Owns the flax train states built on the cross-step gate (:mod:`.train_states`: linen
``TrainState``, NNX ``Optimizer``), NNX modules as arguments of the in-step functions
(:mod:`.nnx_modules`), loss scaling (:mod:`.dynamic_scale`) and Orbax checkpoints
(:mod:`.orbax`, public as ``fxaccum.checkpoint``). May import ``fxaccum.instep``,
``fxaccum.crossstep`` and the shared modules. Imported by ``fxaccum``'s table of names
loaded on first use, by ``fxaccum.checkpoint``, and (NNX modules, where flax is loaded) by
``fxaccum.instep``.
"""
