"""Serving: one stable OpenAI-compatible endpoint in front of the production checkpoint.

- ``answer_check``: does a model's answer decode to text (the smoke test's bar, not "any bytes came back");
- ``smoke``: one greedy chat request to an engine, judged by ``answer_check``; ``smoke_test_in_temporary_engine``
  starts an engine for one request when no serving service runs;
- ``haproxy``: the traffic router (HAProxy from Debian) and its runtime API (ready / drain / maint per colour);
- ``service``: the long-running serving service: blue/green engines behind HAProxy, supervised, following the
  production pointer, with a small control API (switch, status, the model list);
- ``client``: how Dagster and the CLI find a running service and ask it to switch.
"""
