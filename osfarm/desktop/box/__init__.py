"""The box and the agent's world in it: the box's init (namespaces, mounts), the agent's user and
mount namespaces, the file, command and pyautogui-interpreter work done as the agent, and the
launcher's process tree. Imports nothing of the other desktop subpackages."""
