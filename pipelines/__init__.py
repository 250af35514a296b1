"""diffusers-style pipelines (``vispec.pipelines``).

The LlamaGen pipeline is built on the decoders in :mod:`vispec.decoding` and the models in
:mod:`vispec.models`; pipelines stay thin: validate inputs, call a decoder, decode tokens to pixels.
"""
