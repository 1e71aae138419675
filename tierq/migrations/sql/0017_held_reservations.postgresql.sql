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

-- A job's reservation added to (TG_ARGV[0] = '1', the new row) or taken from ('-1', the
-- old row) its key's sums, in this connection's slot (a slot may go below zero: the sums
-- are read over every slot). The tenant's row is locked first (KEY SHARE, as a foreign key
-- check takes it), so a writer always takes the tenant before a sums row: an admission
-- holds the tenant's row and then writes a sums row, and a worker's ending, which writes a
-- sums row and then a usage record (whose foreign key locks the tenant), would otherwise
-- wait for it while holding the row it wants. A tenant deleted in this transaction takes
-- its sums with it: nothing is written.
CREATE OR REPLACE FUNCTION tierq_jobs_held() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_sign bigint := TG_ARGV[0]::bigint;
    v_job jobs := CASE WHEN v_sign > 0 THEN NEW ELSE OLD END;
    v_bound bigint := tierq_output_bound(v_job.params);
BEGIN
    PERFORM 1 FROM tenants WHERE id = v_job.tenant_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO held_reservations AS h (
        tenant_id, tier, input_price, output_price, slot, jobs, reserved_tokens,
        prompt_tokens, output_tokens
    ) VALUES (
        v_job.tenant_id, v_job.tier, coalesce(v_job.input_price, ''),
        coalesce(v_job.output_price, ''), pg_backend_pid() % 16, v_sign,
        v_sign * v_job.reserved_tokens,
        v_sign * greatest(v_job.reserved_tokens - v_bound, 0), v_sign * v_bound
    )
    ON CONFLICT (tenant_id, tier, input_price, output_price, slot) DO UPDATE SET
        jobs = h.jobs + excluded.jobs,
        reserved_tokens = h.reserved_tokens + excluded.reserved_tokens,
        prompt_tokens = h.prompt_tokens + excluded.prompt_tokens,
        output_tokens = h.output_tokens + excluded.output_tokens;
    RETURN NULL;
END
$fn$;

CREATE TRIGGER jobs_hold_inserted AFTER INSERT ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NEW.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_held('1');

CREATE TRIGGER jobs_hold_resumed AFTER UPDATE OF status ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NEW.status IN ('queued', 'running')
                   AND OLD.status NOT IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_held('1');

CREATE TRIGGER jobs_hold_marked AFTER UPDATE OF held_counted ON jobs
FOR EACH ROW WHEN (NEW.held_counted AND NOT OLD.held_counted
                   AND NEW.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_held('1');

CREATE TRIGGER jobs_hold_ended AFTER UPDATE OF status ON jobs
FOR EACH ROW WHEN (OLD.held_counted AND OLD.status IN ('queued', 'running')
                   AND NEW.status NOT IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_held('-1');

CREATE TRIGGER jobs_hold_deleted AFTER DELETE ON jobs
FOR EACH ROW WHEN (OLD.held_counted AND OLD.status IN ('queued', 'running'))
EXECUTE FUNCTION tierq_jobs_held('-1');

-- A job a batch expands into is counted, whichever release's expander wrote it (one of
-- the release before, during a rolling upgrade, writes held_counted false).
CREATE OR REPLACE FUNCTION tierq_jobs_batch_counted() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    NEW.held_counted := true;
    RETURN NEW;
END
$fn$;

CREATE TRIGGER jobs_batch_counted BEFORE INSERT ON jobs
FOR EACH ROW WHEN (NEW.batch_id IS NOT NULL AND NOT NEW.held_counted)
EXECUTE FUNCTION tierq_jobs_batch_counted();

-- A budget set on a tenant, by whichever process: the tenant's row says its jobs are
-- counted, then its unfinished jobs not counted yet are marked (the triggers above add
-- them). The flag's update takes the tenant's row lock, so it waits for every admission
-- holding it (each inserts before it commits), and the admissions after read the flag
-- under that lock: when this commits, every unfinished job of the tenant is counted, and
-- every job admitted after it will be. A tenant with a long backlog has its admissions
-- wait while its jobs are marked, once.
CREATE OR REPLACE FUNCTION tierq_quotas_count_held() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE tenants SET counts_held = true WHERE id = NEW.tenant_id AND NOT counts_held;
    UPDATE jobs SET held_counted = true
    WHERE tenant_id = NEW.tenant_id AND status IN ('queued', 'running') AND NOT held_counted;
    RETURN NULL;
END
$fn$;

CREATE TRIGGER quotas_count_held AFTER INSERT OR UPDATE ON quotas
FOR EACH ROW WHEN (NEW.token_budget IS NOT NULL OR NEW.spend_budget IS NOT NULL)
EXECUTE FUNCTION tierq_quotas_count_held();
