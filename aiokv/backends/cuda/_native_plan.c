/* aiokv's native helper: the planner, which builds a whole job's program from its block and
 * chunk ids. See _native.h. */
#include "_native.h"

typedef struct {
    PyObject_HEAD
} PlannerObject;

PyTypeObject aiokv_PlannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Planner",
    .tp_basicsize = sizeof(PlannerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
};
