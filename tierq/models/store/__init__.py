"""The job store: a job's life — admitted by the whole rule (the tenant's status and key,
the queue bound, quotas, the price), claimed by a worker, finished, failed, handed back,
cancelled by its tenant, billed — and the reads around it, behind one interface
(`JobStore`) that services and workers call, in the manner of procrastinate's connector and
job manager. A tenant stopped has its jobs cancelled here too (`cancel_all`); a batch
winding up cancels its own by the same statements (`models.batches.stop_unfinished`), in
the transaction that holds its fence, so that only its holder does.

- `SqlJobStore` (`sql.py`): PostgreSQL and the embedded SQLite file, through the
  repository functions of `tierq.models.jobs`; admission is one call of the `tierq_admit`
  function on PostgreSQL (tierq/models/admission.py), one hop to the writer thread on SQLite
  (tierq/models/admission_sqlite.py). It owns the hot paths' own connections
  privately: a few raw asyncpg connections on PostgreSQL (`RawPool`), one connection on a
  thread of its own on an SQLite file (`LocalWriter`, group-committed), beside the
  database's SQLAlchemy engine that every other repository shares.
- `MemoryJobStore` (`memory.py`): the same rules over dicts in this process, for tests
  that exercise a worker's or a service's logic and not a database.

Both pass one contract suite (tests/job_store_contract.py), which is what keeps them
equal: admission's answers, the state machine (`tierq.core.states`), one ending per
delivery, the ledger's one row per job, the progress that resumes a handed-back job and is
billed when it is cancelled instead.
"""

from typing import TYPE_CHECKING

from tierq.models.records import Result
from tierq.models.store.base import JobStore, Usage
from tierq.models.store.memory import MemoryJobStore
from tierq.models.store.sql import SqlJobStore

if TYPE_CHECKING:  # mypy holds both to the interface
    _sql: type[JobStore] = SqlJobStore
    _memory: type[JobStore] = MemoryJobStore

__all__ = ["JobStore", "MemoryJobStore", "Result", "SqlJobStore", "Usage"]
