"""What an operator looks at: the Grafana dashboard and Prometheus rules of the plug-in's
metrics, and pictures of a served run from its step log (engine-free: files and HTTP only)."""
