"""The console `kiln serve` shows at `/` (off with --no-console): a playground that chats through the
OpenAI endpoints, a live dashboard fed from the server's own Prometheus registry, and the artifact's card.

  routes.py   the page, its static files and three JSON/SSE endpoints under /console/api
  history.py  samples the registry once a second into a few minutes of dashboard points
  stats.py    one dashboard point from two scrapes: rates, means and windowed percentiles
  card.py     the artifact card: model, quantization, buckets, KV capacity, pass reports
  static/     index.html and console.css; common.js (requests, the key, SSE), chart.js (SVG line
              charts), playground.js, dashboard.js, card.js, console.js (the key gate, tabs, start):
              hand-written, no build step, no CDN
"""

from kiln.serving.console.routes import console_routes

__all__ = ["console_routes"]
