"""Single-process training recipes of the thesis's experiments (the jobs call these; the
distributed engines replace the inner loop later). Each returns a JSON-ready result dict."""
