# Stands in for the official redis image in the compose test (Docker Hub is not reachable here): the
# same Redis 7 from Debian's packages, with the official image's layout (user redis, /data), so the
# compose file's `redis-server --dir /data ...` command and `redis-cli ping` health check run unchanged.
ARG BASE_IMAGE=localhost/stargym-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server=5:7.0.* \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown redis:redis /data
WORKDIR /data
# Debian picks the redis uid; this image only runs under podman in the compose test.
# hadolint ignore=DL3066
USER redis
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]
