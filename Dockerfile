# Sluice image: `sluice-server` by default (the bundled model unless SLUICE_MODEL points
# elsewhere); run `sluice-balancer` from the same image for the balancer.
#
# BASE is any Debian-like image with python3 (3.11 or later), its venv module and
# ca-certificates: by default the one scripts/make-base makes from Debian's packages where no
# registry is reachable; `--build-arg BASE=python:3.11-slim` where one is. PIP_CA (PEM text)
# is trusted by pip beside the base's CAs, for a network whose proxy signs with its own:
#   docker build --network host --build-arg PIP_CA="$(cat /usr/local/share/ca-certificates/*.crt)" -t sluice .
#
# The first stage installs the program into a virtual environment of its own, /opt/sluice (a
# Debian python3 refuses installs into the system's, PEP 668), and the image copies that
# folder whole: no wheel and no PIP_CA (build arguments a RUN uses are recorded in the image's
# history) are in the image's layers. The image holds the installed package and no source
# tree, so it runs what a user's `pip install sluice[cpu]` runs: the model and its samples
# come from the package. EXTRAS picks the build of ONNX Runtime, one of the two and never
# both (they provide one `onnxruntime` module): `cpu` by default. The GPU image,
# `docker build --build-arg EXTRAS=gpu -t sluice-gpu .`, carries the GPU build with the CUDA 13
# and cuDNN libraries from pip and CuPy (about 3 GB); the host needs NVIDIA's driver (release
# 580 or later) and container toolkit (`docker run --gpus all`, or a Kubernetes GPU request:
# deploy/gpu/).
# sluice/ links the top-level folders into the one `sluice` namespace (sluice/server ->
# ../server, sluice/v1 -> ../protos/sluice/v1, ...): copy them together, each at its own path,
# or the package lacks one. perf/ (the benchmarks) is not part of the product and is not
# copied. tests/e2e/test_install.py builds the wheel from exactly these COPY lines.
ARG BASE=sluice-base:bookworm
FROM ${BASE} AS build
ARG EXTRAS=cpu
ARG PIP_CA=
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sluice sluice
COPY protos protos
COPY server server
COPY balancer balancer
COPY client client
RUN if [ -n "$PIP_CA" ]; then printf '%s\n' "$PIP_CA" | cat /etc/ssl/certs/ca-certificates.crt - >/tmp/ca.pem \
 && export PIP_CERT=/tmp/ca.pem; fi \
 && python3 -m venv /opt/sluice \
 && /opt/sluice/bin/pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
 && rm -f /tmp/ca.pem

# The same base, so the venv's python (a link to the base's python3) is where it points.
FROM ${BASE}
ENV PATH=/opt/sluice/bin:$PATH
COPY --from=build /opt/sluice /opt/sluice
RUN python -c "from sluice.models import DIGITS, samples; assert DIGITS.is_file() and len(samples()) == 10" \
 && sluice perf --help >/dev/null
WORKDIR /app
# In a container the server must listen beyond loopback; the node id defaults to the
# hostname, which Kubernetes sets to the pod name. HOME: the user below has none, and the
# manifests mount a writable /tmp over a read-only root (ONNX Runtime keeps a cache there).
ENV SLUICE_HOST=0.0.0.0 SLUICE_PORT=8001 HOME=/tmp
# Only the gRPC port: metrics are off unless asked for, with `--metrics-port 9100` (or
# SLUICE_METRICS_PORT=9100) and `docker run -p 9100:9100`.
EXPOSE 8001
# `nobody`, by number (so Kubernetes' runAsNonRoot can check it): the user deploy/ runs as.
USER 65534:65534
# grpc.health.v1 on SLUICE_PORT, as the Kubernetes probes do: healthy while SERVING, from the
# model's load until SIGTERM (the start period allows the load, and CUDA's, 2 minutes). Set
# the port with SLUICE_PORT rather than --port, so that the check follows it; a plaintext
# check, so under TLS give the container a check of your own (or --no-healthcheck).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:' + os.environ['SLUICE_PORT'])).Check(h.HealthCheckRequest(), timeout=4).status; raise SystemExit(s != h.HealthCheckResponse.SERVING)"]
STOPSIGNAL SIGTERM
CMD ["sluice-server"]
