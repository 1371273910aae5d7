"""The live target: model config, safetensors loading, the MoE forward pass, expert offload to
host memory, and the decoder (see :mod:`.config`, :mod:`.loader`, :mod:`.model`, :mod:`.offload`,
:mod:`.decoder`; the ``specfit decode`` command lives in :mod:`.commands`)."""
