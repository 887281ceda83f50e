"""``acme``: a made-up target, one package with the modules every target has (`mopar.target`),
for tests/test_targets.py and tests/test_registry.py. Registered by the tests only
(``mopar.target.register_target("tests.acme_target")``); no other module knows it."""

from __future__ import annotations

NAME = "acme"
