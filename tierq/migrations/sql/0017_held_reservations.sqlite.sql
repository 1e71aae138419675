-- What queued and running jobs hold against their tenants' budgets, kept as running sums
-- (migration 0017, SQLite): the triggers of 0017_held_reservations.postgresql.sql, which
-- says what they keep and why, in SQLite's words. One writer holds the whole database, so
-- every write goes to slot 0. A job's output bound is written out as
-- tierq/core/messages.py `output_bound` reads it: max_tokens (0 without) for each of its
-- n choices (1 when n is absent or 0).
--
-- A frozen copy: the migration that created the triggers reads it (and tierq/models/
-- tables.py, for a schema made without migrations). A later change is a new file.

CREATE TRIGGER jobs_hold_inserted AFTER INSERT ON jobs
WHEN NEW.held_counted AND NEW.status IN ('queued', 'running')
BEGIN
    INSERT INTO held_reservations (
        tenant_id, tier, input_price, output_price, slot, jobs, reserved_tokens,
        prompt_tokens, output_tokens
    ) VALUES (
        NEW.tenant_id, NEW.tier, coalesce(NEW.input_price, ''), coalesce(NEW.output_price, ''),
        0, 1, NEW.reserved_tokens,
        max(NEW.reserved_tokens - coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1), 0),
        coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1)
    )
    ON CONFLICT (tenant_id, tier, input_price, output_price, slot) DO UPDATE SET
        jobs = jobs + 1,
        reserved_tokens = reserved_tokens + excluded.reserved_tokens,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        output_tokens = output_tokens + excluded.output_tokens;
END;

CREATE TRIGGER jobs_hold_resumed AFTER UPDATE OF status ON jobs
WHEN NEW.held_counted AND NEW.status IN ('queued', 'running')
    AND OLD.status NOT IN ('queued', 'running')
BEGIN
    INSERT INTO held_reservations (
        tenant_id, tier, input_price, output_price, slot, jobs, reserved_tokens,
        prompt_tokens, output_tokens
    ) VALUES (
        NEW.tenant_id, NEW.tier, coalesce(NEW.input_price, ''), coalesce(NEW.output_price, ''),
        0, 1, NEW.reserved_tokens,
        max(NEW.reserved_tokens - coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1), 0),
        coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1)
    )
    ON CONFLICT (tenant_id, tier, input_price, output_price, slot) DO UPDATE SET
        jobs = jobs + 1,
        reserved_tokens = reserved_tokens + excluded.reserved_tokens,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        output_tokens = output_tokens + excluded.output_tokens;
END;

CREATE TRIGGER jobs_hold_marked AFTER UPDATE OF held_counted ON jobs
WHEN NEW.held_counted AND NOT OLD.held_counted AND NEW.status IN ('queued', 'running')
BEGIN
    INSERT INTO held_reservations (
        tenant_id, tier, input_price, output_price, slot, jobs, reserved_tokens,
        prompt_tokens, output_tokens
    ) VALUES (
        NEW.tenant_id, NEW.tier, coalesce(NEW.input_price, ''), coalesce(NEW.output_price, ''),
        0, 1, NEW.reserved_tokens,
        max(NEW.reserved_tokens - coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1), 0),
        coalesce(json_extract(NEW.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(NEW.params, '$.n'), 0), 1)
    )
    ON CONFLICT (tenant_id, tier, input_price, output_price, slot) DO UPDATE SET
        jobs = jobs + 1,
        reserved_tokens = reserved_tokens + excluded.reserved_tokens,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        output_tokens = output_tokens + excluded.output_tokens;
END;

CREATE TRIGGER jobs_hold_ended AFTER UPDATE OF status ON jobs
WHEN OLD.held_counted AND OLD.status IN ('queued', 'running')
    AND NEW.status NOT IN ('queued', 'running')
BEGIN
    UPDATE held_reservations SET
        jobs = jobs - 1,
        reserved_tokens = reserved_tokens - OLD.reserved_tokens,
        prompt_tokens = prompt_tokens
            - max(OLD.reserved_tokens - coalesce(json_extract(OLD.params, '$.max_tokens'), 0)
                  * coalesce(nullif(json_extract(OLD.params, '$.n'), 0), 1), 0),
        output_tokens = output_tokens - coalesce(json_extract(OLD.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(OLD.params, '$.n'), 0), 1)
    WHERE tenant_id = OLD.tenant_id AND tier = OLD.tier
      AND input_price = coalesce(OLD.input_price, '')
      AND output_price = coalesce(OLD.output_price, '') AND slot = 0;
END;

CREATE TRIGGER jobs_hold_deleted AFTER DELETE ON jobs
WHEN OLD.held_counted AND OLD.status IN ('queued', 'running')
BEGIN
    UPDATE held_reservations SET
        jobs = jobs - 1,
        reserved_tokens = reserved_tokens - OLD.reserved_tokens,
        prompt_tokens = prompt_tokens
            - max(OLD.reserved_tokens - coalesce(json_extract(OLD.params, '$.max_tokens'), 0)
                  * coalesce(nullif(json_extract(OLD.params, '$.n'), 0), 1), 0),
        output_tokens = output_tokens - coalesce(json_extract(OLD.params, '$.max_tokens'), 0)
            * coalesce(nullif(json_extract(OLD.params, '$.n'), 0), 1)
    WHERE tenant_id = OLD.tenant_id AND tier = OLD.tier
      AND input_price = coalesce(OLD.input_price, '')
      AND output_price = coalesce(OLD.output_price, '') AND slot = 0;
END;

-- A budget set on a tenant: its row says its jobs are counted, and its unfinished jobs
-- not counted yet are marked (the triggers above add them); see the PostgreSQL file.
CREATE TRIGGER quotas_count_held_inserted AFTER INSERT ON quotas
WHEN NEW.token_budget IS NOT NULL OR NEW.spend_budget IS NOT NULL
BEGIN
    UPDATE tenants SET counts_held = 1 WHERE id = NEW.tenant_id AND NOT counts_held;
    UPDATE jobs SET held_counted = 1
    WHERE tenant_id = NEW.tenant_id AND status IN ('queued', 'running') AND NOT held_counted;
END;

CREATE TRIGGER quotas_count_held_updated AFTER UPDATE ON quotas
WHEN NEW.token_budget IS NOT NULL OR NEW.spend_budget IS NOT NULL
BEGIN
    UPDATE tenants SET counts_held = 1 WHERE id = NEW.tenant_id AND NOT counts_held;
    UPDATE jobs SET held_counted = 1
    WHERE tenant_id = NEW.tenant_id AND status IN ('queued', 'running') AND NOT held_counted;
END;
