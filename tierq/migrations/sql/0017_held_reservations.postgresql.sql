-- What queued and running jobs hold against their tenants' budgets, kept as running sums
-- (migration 0017, PostgreSQL).
--
-- held_reservations has rows per tenant, tier and pair of prices: the jobs queued or
-- running, their reserved tokens, the prompt part of those (the reservation less the
-- output bound) and the output bound (max_tokens for each of n choices). A job's most
-- cost is linear in these (models.quotas `reservation_cost`), so a budget's check reads a
-- few rows and prices them exactly, where it summed the tenant's whole backlog before.
--
-- Each key has up to 16 rows (`slot`), a connection writing the one its backend's pid
-- picks: admissions of one tenant side by side (without quotas they take its row lock
-- shared) and the workers ending its jobs would otherwise queue on one row until each
-- other's commits. A sum reads them all.
--
-- Triggers on jobs keep them for the jobs marked `held_counted`, in the transaction that
-- writes the job, whichever path writes it (admission, a worker's ending, a tenant's or a
-- batch's cancel, the reconciler, a row deleted): such a job adds itself when it is
-- inserted queued or running, or marked while it is, and takes itself away when its
-- status leaves them or it is deleted. A move between queued and running changes nothing
-- and fires nothing. A job's tenant, tier, prices, params and reservation are written
-- once, at its insert.
--
-- Which jobs are counted: every job of a tenant whose row says `counts_held` (it has or
-- had a budget; admission reads the flag under the tenant's row lock it takes anyway),
-- and every job a batch's expansion writes (bulk work, where a trigger costs nothing
-- beside the run). Setting a budget sets the flag, which waits for the admissions holding
-- the tenant's lock, then marks the tenant's unfinished jobs, in one transaction: every
-- unfinished job of a tenant with a budget is counted. The other tenants' admissions fire
-- no trigger (the WHEN clauses are evaluated without calling a function): an upsert on
-- each would cost them about a tenth of their admission throughput.
--
-- A frozen copy: the migration that created the triggers reads it (and tierq/models/
-- tables.py, for a schema made without migrations). A later change is a new file.

-- A job's output bound, as tierq/core/messages.py `output_bound` reads it: max_tokens (0
-- without) for each of its n choices (1 when n is absent or 0).
CREATE OR REPLACE FUNCTION tierq_output_bound(p_params json) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $fn$
    SELECT coalesce((p_params->>'max_tokens')::bigint, 0)
        * coalesce(nullif((p_params->>'n')::bigint, 0), 1)
$fn$;

CREATE OR REPLACE FUNCTION tierq_jobs_hold() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_bound bigint := tierq_output_bound(NEW.params);
BEGIN
    INSERT INTO held_reservations AS h (
        tenant_id, tier, input_price, output_price, slot, jobs, reserved_tokens,
        prompt_tokens, output_tokens
    ) VALUES (
        NEW.tenant_id, NEW.tier, coalesce(NEW.input_price, ''), coalesce(NEW.output_price, ''),
        pg_backend_pid() % 16, 1, NEW.reserved_tokens,
        greatest(NEW.reserved_tokens - v_bound, 0), v_bound
    )
    ON CONFLICT (tenant_id, tier, input_price, output_price, slot) DO UPDATE SET
        jobs = h.jobs + 1,
        reserved_tokens = h.reserved_tokens + excluded.reserved_tokens,
        prompt_tokens = h.prompt_tokens + excluded.prompt_tokens,
        output_tokens = h.output_tokens + excluded.output_tokens;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION tierq_jobs_release() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_bound bigint := tierq_output_bound(OLD.params);
BEGIN
    -- Taken from this connection's slot, which may go below zero: the sums are read
    -- over every slot. No row is made here when the slot has none yet (a tenant being
    -- deleted has its sums deleted with it): the slot of the job's own insert holds it.
    UPDATE held_reservations SET
        jobs = jobs - 1,
        reserved_tokens = reserved_tokens - OLD.reserved_tokens,
        prompt_tokens = prompt_tokens - greatest(OLD.reserved_tokens - v_bound, 0),
        output_tokens = output_tokens - v_bound
    WHERE tenant_id = OLD.tenant_id AND tier = OLD.tier
      AND input_price = coalesce(OLD.input_price, '')
      AND output_price = coalesce(OLD.output_price, '')
      AND slot = pg_backend_pid() % 16;
    IF NOT FOUND THEN
        UPDATE held_reservations SET
            jobs = jobs - 1,
            reserved_tokens = reserved_tokens - OLD.reserved_tokens,
            prompt_tokens = prompt_tokens - greatest(OLD.reserved_tokens - v_bound, 0),
            output_tokens = output_tokens - v_bound
        WHERE (tenant_id, tier, input_price, output_price, slot) = (
            SELECT tenant_id, tier, input_price, output_price, slot FROM held_reservations
            WHERE tenant_id = OLD.tenant_id AND tier = OLD.tier
              AND input_price = coalesce(OLD.input_price, '')
              AND output_price = coalesce(OLD.output_price, '')
            ORDER BY slot LIMIT 1);
    END IF;
    RETURN NULL;
END
$fn$;

CREATE TRIGGER jobs_hold_inserted AFTER INSERT ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NEW.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_hold();

CREATE TRIGGER jobs_hold_resumed AFTER UPDATE OF status ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NEW.status IN ('queued', 'running')
                   AND OLD.status NOT IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_hold();

CREATE TRIGGER jobs_hold_marked AFTER UPDATE OF held_counted ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NOT OLD.held_counted
                   AND NEW.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_hold();

CREATE TRIGGER jobs_hold_ended AFTER UPDATE OF status ON jobs
FOR EACH ROW WHEN (OLD.held_counted AND OLD.status IN ('queued', 'running')
                   AND NEW.status NOT IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_release();

CREATE TRIGGER jobs_hold_deleted AFTER DELETE ON jobs
FOR EACH ROW WHEN (OLD.held_counted AND OLD.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_release();
