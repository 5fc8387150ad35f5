"""An idle keep-alive connection of the HTTP server outlives the ``openai`` client's own idle
expiry, so the client always closes first (a server closing one as the client reuses it fails that
request). Served in-process with no engine: ``/v1/models`` needs none."""

import http.client
import sys
import time
from pathlib import Path

from mcore_inference import InferenceClient
from mcore_inference.server import build_app, load_tokenizer
from openai._constants import DEFAULT_CONNECTION_LIMITS

sys.path.insert(0, str(Path(__file__).parent))
from server_stack import MODEL, serve_in_thread, write_char_tokenizer


def test_an_idle_connection_outlives_the_openai_clients_expiry(tmp_path):
    write_char_tokenizer(tmp_path)
    client = InferenceClient("tcp://127.0.0.1:1")  # never used: /v1/models asks no engine
    app = build_app(client, load_tokenizer(tmp_path), model_name=MODEL, max_model_len=64)
    url, server, thread = serve_in_thread(app)
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        for attempt in range(2):
            if attempt:  # idle past the client's expiry: the server must still hold the connection
                time.sleep(DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1.0)
            connection.request("GET", "/v1/models")
            response = connection.getresponse()
            assert response.status == 200 and MODEL.encode() in response.read()
    finally:
        connection.close()
        server.should_exit = True
        thread.join(10)
