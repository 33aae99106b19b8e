"""Llama 3.x JSON tool calls (``llama3_json``): the model writes each call as a JSON object,
``{"name": "get_weather", "parameters": {"city": "Paris"}}`` (``"arguments"`` is accepted
too), parallel calls separated by ``;``, sometimes after the ``<|python_tag|>`` token.

An object is a call once its name and its arguments key are written; any other JSON in the
content (an object whose first key is neither ``name`` nor ``type``, or that closes without
both) stays content. Streaming follows `pkgd.parsers.streaming`: the name, then the arguments
as they are written.
"""

from __future__ import annotations

from pkgd.parsers.streaming import CallRegion, JsonCallsRegion, MarkedToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(MarkedToolParser):
    markers = (PYTHON_TAG, "{")

    def new_region(self, marker: str) -> CallRegion:
        return JsonCallsRegion(marker, self.tools, array=False, lead=marker == "{")
