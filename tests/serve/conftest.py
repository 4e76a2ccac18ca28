from tests.serve.servers import artifacts, char_tokenizer_dir, tokenizer_dir  # noqa: F401 - fixtures
