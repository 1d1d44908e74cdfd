"""Integrations of attnplug with model libraries.

* ``attnplug.integrations.transformers``: Hugging Face ``transformers`` causal LMs run through
  an attnplug backend (``pip install attnplug[hf]``).
"""
