# Sluice image: `sluice-server` by default (the bundled model unless SLUICE_MODEL points
# elsewhere); run `sluice-balancer` from the same image for the balancer.
# sluice/ links the top-level folders into the one `sluice` namespace: copy them together.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sluice sluice
COPY protos protos
COPY server server
COPY balancer balancer
COPY client client
COPY perf perf
COPY models models
RUN pip install --no-cache-dir .
# In a container the server must listen beyond loopback; the node id defaults to the
# hostname, which Kubernetes sets to the pod name.
ENV SLUICE_HOST=0.0.0.0 SLUICE_PORT=8001
EXPOSE 8001
STOPSIGNAL SIGTERM
CMD ["sluice-server"]
