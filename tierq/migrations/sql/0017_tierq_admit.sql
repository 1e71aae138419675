-- tierq_admit(): admission on PostgreSQL, in one round trip (migration 0017).
--
-- As migration 0016 defined it, but for what a tenant's unfinished work holds against a
-- budget: the queued and running jobs' reservations are read from their running sums
-- (held_reservations, kept by the triggers of 0017_held_reservations.postgresql.sql, which
-- says which jobs they count), no longer summed over the tenant's backlog on each
-- admission; and the job of a tenant whose row says `counts_held` is written
-- `held_counted`, the flag read with the tenant's status under the lock taken before.
-- A tenant with a budget and 10^5 queued jobs is admitted as fast as one with none.
--
-- The rule, once: a replay of an Idempotency-Key is answered with the job it made; a tenant
-- with quotas for the tier has them checked under its exclusive row lock, against a
-- reservation counted by the served model's tokenizer (`p_exact`; a bound is sent back to
-- be counted first, with nothing written); the tenant's status and the request's key are
-- read under its lock; the default bound on waiting jobs (DEFAULT_MAX_QUEUED) applies
-- unless an all-tiers quota sets max_queued; the price in force is found (the batch tier
-- without a price of its own pays the standard tier's times `p_batch_keep`); the job and
-- its first transition are inserted when every check passed. Nothing is written unless
-- the job is admitted.
--
-- It answers with JSON: `replay` (and `same_request`) for a key used before, `count_first`,
-- or the tenant's status and the key's, the queue bound's count, each quota's limits and
-- the figures it was checked against, the job's id (when admitted), its prices and its
-- reservation's cost. The caller words a refusal from the figures with the rule the ORM
-- path uses (tierq/models/quotas.py `decide`). Money is `numeric` throughout; the
-- reservation's cost and what unfinished work holds are in millionths.
--
-- A frozen copy: the migration that created the function reads it. A later change to the
-- rule is a new file and a new migration.

-- The answer to a replay of an Idempotency-Key, or NULL when the key made no job (yet).
CREATE OR REPLACE FUNCTION tierq_admit_replay(
    p_tenant text, p_idempotency_key text, p_request_hash text
) RETURNS json
LANGUAGE sql STABLE AS $fn$
    SELECT json_build_object(
        'replay', id, 'same_request', request_hash IS NOT DISTINCT FROM p_request_hash)
    FROM jobs
    WHERE p_idempotency_key IS NOT NULL
      AND tenant_id = p_tenant AND idempotency_key = p_idempotency_key
$fn$;

CREATE OR REPLACE FUNCTION tierq_admit(
    p_tenant text, p_key text, p_tier text, p_default_max_queued integer, p_model text,
    p_batch_keep numeric, p_job text, p_messages json, p_prompt text, p_params json,
    p_metadata json, p_idempotency_key text, p_request_hash text, p_now timestamptz,
    p_reserved bigint, p_max_tokens bigint, p_day text, p_month text, p_grace interval,
    p_exact boolean
) RETURNS json
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_status text;
    v_key_ok boolean := true;
    v_in numeric;
    v_out numeric;
    v_cost_micro numeric;
    v_queued bigint;
    v_bound boolean;
    v_pass boolean := true;
    v_figures jsonb := '[]'::jsonb;
    v_id text;
    q record;
    m_n bigint;
    m_used bigint;
    m_oldest timestamptz;
    w_n bigint;
    h_tokens bigint;
    h_micro numeric;
    b_tokens bigint;
    b_cost numeric;
    s_tokens bigint;
    s_cost numeric;
    v_ok boolean;
    v_quotas boolean;
    v_replay json;
    v_counted boolean := false;
BEGIN
    -- A replay of an Idempotency-Key is answered with the job it made, before any check:
    -- no quota is charged twice. It is looked for again wherever the job would be refused:
    -- a request with the same key that committed while this one waited for the tenant's
    -- lock is in the figures read after it, and its job is this request's answer.
    IF p_idempotency_key IS NOT NULL THEN
        v_replay := tierq_admit_replay(p_tenant, p_idempotency_key, p_request_hash);
        IF v_replay IS NOT NULL THEN
            RETURN v_replay;
        END IF;
    END IF;

    -- Quotas that admission checks (max_running alone is the dispatcher's). They are
    -- checked against the prompt as the served model's tokenizer counts it: a reservation
    -- that is only a bound (`p_exact` false) is sent back to be counted first.
    v_quotas := EXISTS (
        SELECT 1 FROM quotas
        WHERE tenant_id = p_tenant AND tier IN ('*', p_tier)
          AND (requests_per_minute IS NOT NULL OR tokens_per_minute IS NOT NULL
               OR max_queued IS NOT NULL OR token_budget IS NOT NULL
               OR spend_budget IS NOT NULL)
    );

    -- With quotas, the tenant's admissions run one at a time (the exclusive lock): each
    -- one's figures include every admission before it. Without, side by side (shared).
    -- Either way a suspension or a key's revocation, which take the exclusive lock first,
    -- committed before this one refuses it, and every statement after the lock reads
    -- what committed before it (a VOLATILE function's statements each take a snapshot).
    -- A reservation still to be counted takes no lock: nothing is checked or written now,
    -- and its status is read only so that a request refused anyway is not counted first.
    IF NOT v_quotas THEN
        SELECT status, counts_held INTO v_status, v_counted
        FROM tenants WHERE id = p_tenant FOR SHARE;
    ELSIF p_exact THEN
        SELECT status, counts_held INTO v_status, v_counted
        FROM tenants WHERE id = p_tenant FOR UPDATE;
    ELSE
        SELECT status INTO v_status FROM tenants WHERE id = p_tenant;
    END IF;
    IF NOT FOUND THEN
        RETURN json_build_object('tenant_status', NULL);
    END IF;
    IF p_key IS NOT NULL THEN
        SELECT revoked_at IS NULL INTO v_key_ok
        FROM api_keys WHERE id = p_key AND tenant_id = p_tenant;
        v_key_ok := coalesce(v_key_ok, false);
    END IF;
    IF v_status <> 'active' OR NOT v_key_ok THEN
        v_replay := tierq_admit_replay(p_tenant, p_idempotency_key, p_request_hash);
        RETURN coalesce(v_replay, json_build_object('tenant_status', v_status, 'key_ok', v_key_ok));
    END IF;
    IF v_quotas AND NOT p_exact THEN
        RETURN json_build_object('count_first', true);
    END IF;

    -- The tier's own price in force, else (the batch tier) the standard one's share.
    -- Statements are few on purpose: each costs an executor's start and end.
    SELECT i, o INTO v_in, v_out FROM (
        SELECT input_per_million::numeric AS i, output_per_million::numeric AS o,
               0 AS fallback, effective_at, id
        FROM prices WHERE model = p_model AND tier = p_tier
        UNION ALL
        SELECT input_per_million::numeric * p_batch_keep,
               output_per_million::numeric * p_batch_keep, 1, effective_at, id
        FROM prices WHERE model = p_model AND tier = 'standard' AND p_tier = 'batch'
    ) found
    ORDER BY fallback, effective_at DESC, id DESC LIMIT 1;
    v_in := coalesce(v_in, 0);
    v_out := coalesce(v_out, 0);
    v_cost_micro := greatest(0, p_reserved - p_max_tokens) * v_in + p_max_tokens * v_out;

    -- The waiting jobs, up to the bound; NULL where no bound applies.
    SELECT CASE WHEN p_default_max_queued > 0 AND NOT EXISTS (
               SELECT 1 FROM quotas
               WHERE tenant_id = p_tenant AND tier = '*' AND max_queued IS NOT NULL
           ) THEN (
               SELECT count(*) FROM (
                   SELECT 1 FROM jobs
                   WHERE tenant_id = p_tenant AND status = 'queued' AND batch_id IS NULL
                   LIMIT p_default_max_queued
               ) waiting
           ) END
    INTO v_queued;
    v_bound := v_queued IS NOT NULL;
    IF v_queued >= p_default_max_queued THEN  -- NULL (no bound): not refused
        v_pass := false;
    END IF;

    IF v_quotas THEN  -- only those found above: none is checked under the shared lock
        FOR q IN
            SELECT tier, requests_per_minute, tokens_per_minute, max_queued, token_budget,
                   spend_budget::numeric AS spend_budget, budget_period
            FROM quotas
            WHERE tenant_id = p_tenant AND tier IN ('*', p_tier)
              AND (requests_per_minute IS NOT NULL OR tokens_per_minute IS NOT NULL
                   OR max_queued IS NOT NULL OR token_budget IS NOT NULL
                   OR spend_budget IS NOT NULL)
            ORDER BY tier <> '*', tier
        LOOP
            m_n := 0; m_used := 0; m_oldest := NULL; w_n := 0;
            h_tokens := 0; h_micro := 0; s_tokens := 0; s_cost := 0;
            IF q.requests_per_minute IS NOT NULL OR q.tokens_per_minute IS NOT NULL THEN
                SELECT count(*),
                       coalesce(sum(coalesce(prompt_tokens + completion_tokens, reserved_tokens)), 0),
                       min(created_at)
                INTO m_n, m_used, m_oldest
                FROM jobs
                WHERE tenant_id = p_tenant AND created_at >= p_now - interval '60 seconds'
                  AND batch_id IS NULL AND (q.tier = '*' OR tier = q.tier);
            END IF;
            IF q.max_queued IS NOT NULL THEN
                SELECT count(*) INTO w_n FROM jobs
                WHERE tenant_id = p_tenant AND status = 'queued' AND batch_id IS NULL
                  AND (q.tier = '*' OR tier = q.tier);
            END IF;
            IF q.token_budget IS NOT NULL OR q.spend_budget IS NOT NULL THEN
                IF q.tier IN ('*', 'batch') THEN
                    SELECT coalesce(sum(reserved_tokens), 0),
                           coalesce(sum(reserved_cost::numeric), 0)
                    INTO b_tokens, b_cost
                    FROM batches
                    WHERE tenant_id = p_tenant AND status IN ('validating', 'in_progress');
                    h_tokens := b_tokens;
                    h_micro := b_cost * 1000000;
                END IF;
                -- Queued and running jobs, from their running sums (held_reservations,
                -- kept by triggers on jobs): a few rows whatever the backlog.
                SELECT h_tokens + coalesce(sum(reserved_tokens), 0),
                       h_micro + coalesce(sum(
                           prompt_tokens * coalesce(nullif(input_price, '')::numeric, 0)
                           + output_tokens * coalesce(nullif(output_price, '')::numeric, 0)), 0)
                INTO h_tokens, h_micro
                FROM held_reservations
                WHERE tenant_id = p_tenant AND (q.tier = '*' OR tier = q.tier);
                -- Jobs cancelled while they ran whose usage is not recorded yet, within
                -- the grace (ix_jobs_unbilled_cancel: only those rows are read).
                SELECT h_tokens + coalesce(sum(reserved_tokens), 0),
                       h_micro + coalesce(sum(
                           greatest(0, reserved_tokens - tierq_output_bound(params))
                               * coalesce(input_price::numeric, 0)
                           + tierq_output_bound(params) * coalesce(output_price::numeric, 0)), 0)
                INTO h_tokens, h_micro
                FROM jobs
                WHERE tenant_id = p_tenant AND (q.tier = '*' OR tier = q.tier)
                  AND status = 'cancelled' AND started_at IS NOT NULL
                  AND prompt_tokens IS NULL AND finished_at > p_now - p_grace;
                SELECT coalesce(sum(tokens), 0), coalesce(sum(cost::numeric), 0)
                INTO s_tokens, s_cost
                FROM spend_counters
                WHERE tenant_id = p_tenant AND (q.tier = '*' OR tier = q.tier)
                  AND period_key = CASE q.budget_period
                      WHEN 'day' THEN p_day WHEN 'month' THEN p_month ELSE 'total' END;
            END IF;
            v_ok := (q.requests_per_minute IS NULL OR m_n < q.requests_per_minute)
                AND (q.tokens_per_minute IS NULL OR m_used + p_reserved <= q.tokens_per_minute)
                AND (q.max_queued IS NULL OR w_n < q.max_queued)
                AND (q.token_budget IS NULL
                     OR s_tokens + h_tokens + p_reserved <= q.token_budget)
                AND (q.spend_budget IS NULL
                     OR s_cost * 1000000 + h_micro + v_cost_micro <= q.spend_budget * 1000000);
            v_pass := v_pass AND v_ok;
            v_figures := v_figures || jsonb_build_array(jsonb_build_object(
                'tier', q.tier, 'ok', v_ok,
                'requests_per_minute', q.requests_per_minute,
                'tokens_per_minute', q.tokens_per_minute, 'max_queued', q.max_queued,
                'token_budget', q.token_budget, 'spend_budget', q.spend_budget::text,
                'budget_period', q.budget_period,
                'minute_requests', m_n, 'minute_tokens', m_used, 'minute_oldest', m_oldest,
                'queued', w_n, 'held_tokens', h_tokens, 'held_micro', h_micro::text,
                'spent_tokens', s_tokens, 'spent_cost', s_cost::text));
        END LOOP;
    END IF;

    IF v_pass THEN
        -- The job and its first transition, in one statement.
        WITH ins AS (
            INSERT INTO jobs (
                id, tenant_id, tier, model, status, messages, prompt, params, metadata,
                idempotency_key, request_hash, created_at, deliveries, preemptions,
                reserved_tokens, input_price, output_price, held_counted
            ) VALUES (
                p_job, p_tenant, p_tier, p_model, 'queued', p_messages, p_prompt, p_params,
                p_metadata, p_idempotency_key, p_request_hash, p_now, 0, 0, p_reserved,
                v_in::text, v_out::text, v_counted
            )
            ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
            RETURNING id
        )
        INSERT INTO job_transitions (job_id, status, at)
        SELECT id, 'queued', p_now FROM ins
        RETURNING job_id INTO v_id;
        IF v_id IS NULL THEN
            -- A concurrent request with the same Idempotency-Key inserted first.
            RETURN tierq_admit_replay(p_tenant, p_idempotency_key, p_request_hash);
        END IF;
    ELSE
        v_replay := tierq_admit_replay(p_tenant, p_idempotency_key, p_request_hash);
        IF v_replay IS NOT NULL THEN
            RETURN v_replay;
        END IF;
    END IF;
    RETURN json_build_object(
        'tenant_status', v_status, 'key_ok', true, 'bound', v_bound, 'queued', v_queued,
        'quotas', v_figures, 'id', v_id, 'input_price', v_in::text,
        'output_price', v_out::text, 'cost_micro', v_cost_micro::text);
END
$fn$;
