"""The HTTP front of a pdserve server: tokenize, dispatch to DP workers, detokenize, stream.

No torch here (not even indirectly): the front runs next to workers that own the model.
Entry points: `launch.run_server` (blocking) and `launch.create_app` (an ASGI app for tests).
"""
