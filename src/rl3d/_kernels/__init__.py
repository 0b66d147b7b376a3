"""Resharding kernels shipped with rl3d (see rl3d.ops).

Their sources live in the repository's top-level ``kernels/`` folder, which setup.py maps onto
``rl3d._kernels.triton`` and ``rl3d._kernels.cuda``. That folder has no ``__init__.py`` of its own,
so a Python started in the checkout never imports it as a top-level ``kernels`` ahead of an
installed package of that name (Hugging Face's, which transformers imports).
"""
