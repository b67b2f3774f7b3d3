# Sluice image: `sluice-server` by default (the bundled model unless SLUICE_MODEL points
# elsewhere); run `sluice-balancer` from the same image for the balancer.
#
# The first stage builds the wheel. sluice/ links the top-level folders into the one `sluice`
# namespace (sluice/server -> ../server, sluice/v1 -> ../protos/sluice/v1, ...): copy them
# together, each at its own path, or the wheel lacks a package. perf/ (the benchmarks) is not
# part of the product and is not copied. tests/e2e/test_install.py builds the wheel from
# exactly these COPY lines.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sluice sluice
COPY protos protos
COPY server server
COPY balancer balancer
COPY client client
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

# The image holds the installed wheel and no source tree, so it runs what a user's
# `pip install sluice` runs: the model and its samples come from the package.
# The GPU image: `docker build --build-arg EXTRAS=gpu -t sluice:gpu .` adds the CUDA 13 and
# cuDNN libraries from pip and CuPy (about 3 GB); the host needs NVIDIA's driver (release 580
# or later) and container toolkit (`docker run --gpus all`, or a Kubernetes GPU request).
FROM python:3.11-slim
ARG EXTRAS=""
COPY --from=build /wheels /wheels
RUN whl=$(ls /wheels/*.whl) && pip install --no-cache-dir "${whl}${EXTRAS:+[$EXTRAS]}" \
 && rm -rf /wheels \
 && python -c "from sluice.models import DIGITS, samples; assert DIGITS.is_file() and len(samples()) == 10" \
 && sluice perf --help >/dev/null
WORKDIR /app
# In a container the server must listen beyond loopback; the node id defaults to the
# hostname, which Kubernetes sets to the pod name.
ENV SLUICE_HOST=0.0.0.0 SLUICE_PORT=8001
EXPOSE 8001 9100
STOPSIGNAL SIGTERM
CMD ["sluice-server"]
