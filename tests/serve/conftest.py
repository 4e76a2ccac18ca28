from tests.serve.servers import artifacts, tokenizer_dir  # noqa: F401 - fixtures
