"""kiln on Ray Serve: an ingress speaking kiln serve's OpenAI API in front of replicas that each
hold one engine client, a prefix-aware request router, an autoscaling policy fed by admission
control, and hedged requests (docs/deployment.md).

Layering: this package may import the runtime, the serving layer, the contract and the configs;
nothing below it imports it. Ray is imported only by the modules that need it (replica, router,
ingress, app), so the pure decision logic (prefix, routing, autoscale, hedge) tests without Ray.
"""
